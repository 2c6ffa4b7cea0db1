//! Idempotency keys: the `Idempotency-Key` header value, and the opaque keys of idempotent
//! functions (message ids).

use std::fmt;

/// Longest key accepted: 255 characters for a header's key (after unquoting; visible ASCII,
/// so also 255 bytes), 255 bytes for an opaque one ([`IdempotencyKey::opaque`]).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, made one of two ways:
///
/// - **from an `Idempotency-Key` header** ([`IdempotencyKey::parse`]): 1–255 visible ASCII
///   characters. Parses both the IETF draft's form, an RFC 8941 sf-string (`"8e03978e-…"`),
///   and the bare form Stripe accepts (`8e03978e-…`). Both forms of the same text are the
///   same key;
/// - **as opaque text** ([`IdempotencyKey::opaque`]), for idempotent functions: a message id
///   is the key byte for byte, with no trimming or unquoting, since it never was a header.
///
/// ```
/// use idempotent_core::IdempotencyKey;
///
/// let quoted = IdempotencyKey::parse(br#""order-42""#)?;
/// let bare = IdempotencyKey::parse(b"order-42")?;
/// assert_eq!(quoted, bare);
/// assert_eq!(bare.as_str(), "order-42");
/// // A message id is its own text: these are three keys.
/// assert_ne!(IdempotencyKey::opaque(" order-42")?, bare);
/// assert_ne!(IdempotencyKey::opaque(r#""order-42""#)?, bare);
/// assert_eq!(IdempotencyKey::opaque("order-42")?, bare);
/// # Ok::<(), idempotent_core::KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

/// Why a header value is not a usable idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The route requires a key and the request carries none.
    #[error("the request has no `Idempotency-Key` header")]
    Missing,
    /// The request carries more than one `Idempotency-Key` header line.
    #[error("the request has {count} `Idempotency-Key` header lines; send exactly one")]
    Multiple {
        /// How many header lines were present.
        count: usize,
    },
    /// The key is empty (a header's: or only whitespace, or `""`).
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes (a header's key is ASCII: as many
    /// characters).
    #[error("the idempotency key is {len} bytes long; at most {MAX_KEY_LEN} are allowed")]
    TooLong {
        /// Length of the key in bytes (a header's: after unquoting).
        len: usize,
    },
    /// An opaque key ([`IdempotencyKey::opaque`]) holds a NUL character, which SQL stores
    /// cannot hold (PostgreSQL's `text` refuses it).
    #[error("the idempotency key holds a NUL character (at byte {position})")]
    Nul {
        /// Its position in the key, in bytes from 0.
        position: usize,
    },
    /// The key holds a byte that is not visible ASCII (`0x21..=0x7E`).
    #[error(
        "the idempotency key has a character that is not visible ASCII (byte 0x{byte:02x} at position {position})"
    )]
    InvalidChar {
        /// The offending byte.
        byte: u8,
        /// Its position in the (unquoted) key, from 0.
        position: usize,
    },
    /// The value starts with `"` but is not a well-formed RFC 8941 sf-string.
    #[error("the idempotency key is not a well-formed quoted string: {reason}")]
    BadQuoting {
        /// What is wrong with the quoting.
        reason: &'static str,
    },
}

impl IdempotencyKey {
    /// Parses one header value (raw bytes, as HTTP delivers them).
    ///
    /// Surrounding spaces and tabs are ignored. A value starting with `"` must be a complete
    /// sf-string (`\"` and `\\` are the only escapes); otherwise the whole value is the key.
    ///
    /// # Errors
    /// [`KeyError::Empty`], [`KeyError::TooLong`], [`KeyError::InvalidChar`] or
    /// [`KeyError::BadQuoting`].
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let value = trim_ows(value);
        if value.first() == Some(&b'"') {
            let inner = unquote(value)?;
            Self::validate(inner)
        } else {
            Self::validate(value.to_vec())
        }
    }

    /// An opaque key: `value` as it is, byte for byte, for keys that never were an HTTP header
    /// (an idempotent function's message id, [`CallKey`](crate::call::CallKey)). Nothing is
    /// trimmed or unquoted: `m1`, ` m1` and `"m1"` are three keys. Any text is a key except
    /// an empty one, one longer than [`MAX_KEY_LEN`] bytes (the stores' bound) and one holding
    /// NUL (which SQL stores cannot hold).
    ///
    /// ```
    /// use idempotent_core::{IdempotencyKey, KeyError};
    /// assert_eq!(IdempotencyKey::opaque(" évé 1\t")?.as_str(), " évé 1\t");
    /// assert_eq!(IdempotencyKey::opaque(""), Err(KeyError::Empty));
    /// assert_eq!(IdempotencyKey::opaque("é".repeat(128)), Err(KeyError::TooLong { len: 256 }));
    /// assert_eq!(IdempotencyKey::opaque("m\01"), Err(KeyError::Nul { position: 1 }));
    /// # Ok::<(), KeyError>(())
    /// ```
    ///
    /// # Errors
    /// [`KeyError::Empty`], [`KeyError::TooLong`] or [`KeyError::Nul`].
    pub fn opaque(value: impl Into<String>) -> Result<Self, KeyError> {
        let value = value.into();
        if value.is_empty() {
            return Err(KeyError::Empty);
        }
        if value.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: value.len() });
        }
        if let Some(position) = value.bytes().position(|b| b == 0) {
            return Err(KeyError::Nul { position });
        }
        Ok(IdempotencyKey(value))
    }

    /// Parses the key from all `Idempotency-Key` header lines of a request.
    ///
    /// No line → [`KeyError::Missing`]; more than one → [`KeyError::Multiple`].
    ///
    /// ```
    /// use idempotent_core::{IdempotencyKey, KeyError};
    ///
    /// assert_eq!(IdempotencyKey::from_header_values::<&[u8]>([]), Err(KeyError::Missing));
    /// let two: [&[u8]; 2] = [b"a", b"b"];
    /// assert_eq!(IdempotencyKey::from_header_values(two), Err(KeyError::Multiple { count: 2 }));
    /// ```
    ///
    /// # Errors
    /// As [`IdempotencyKey::parse`], plus `Missing` and `Multiple`.
    pub fn from_header_values<V: AsRef<[u8]>>(
        values: impl IntoIterator<Item = V>,
    ) -> Result<Self, KeyError> {
        let mut iter = values.into_iter();
        let Some(first) = iter.next() else {
            return Err(KeyError::Missing);
        };
        let rest = iter.count();
        if rest > 0 {
            return Err(KeyError::Multiple { count: rest + 1 });
        }
        Self::parse(first.as_ref())
    }

    fn validate(bytes: Vec<u8>) -> Result<Self, KeyError> {
        if bytes.is_empty() {
            return Err(KeyError::Empty);
        }
        if let Some(position) = bytes.iter().position(|b| !b.is_ascii_graphic()) {
            return Err(KeyError::InvalidChar {
                byte: bytes[position],
                position,
            });
        }
        if bytes.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: bytes.len() });
        }
        // Every byte is visible ASCII, so this cannot fail; map defensively anyway.
        String::from_utf8(bytes)
            .map(IdempotencyKey)
            .map_err(|_| KeyError::BadQuoting {
                reason: "not ASCII",
            })
    }

    /// The key's text (a header's: unquoted).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an RFC 8941 sf-string, as the IETF draft sends it. Only a key parsed from a
    /// header is sure to be one a header can carry; an [opaque](IdempotencyKey::opaque) key
    /// may hold characters no sf-string may.
    ///
    /// ```
    /// # use idempotent_core::IdempotencyKey;
    /// let key = IdempotencyKey::parse(br#"a"b"#)?;
    /// assert_eq!(key.to_sf_string(), r#""a\"b""#);
    /// # Ok::<(), idempotent_core::KeyError>(())
    /// ```
    pub fn to_sf_string(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 2);
        out.push('"');
        for c in self.0.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

fn unquote(value: &[u8]) -> Result<Vec<u8>, KeyError> {
    // RFC 8941 §4.2.5: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE
    let mut out = Vec::with_capacity(value.len());
    let mut iter = value[1..].iter().copied();
    loop {
        match iter.next() {
            None => {
                return Err(KeyError::BadQuoting {
                    reason: "missing closing quote",
                });
            }
            Some(b'\\') => match iter.next() {
                Some(c @ (b'"' | b'\\')) => out.push(c),
                Some(_) => {
                    return Err(KeyError::BadQuoting {
                        reason: "only `\\\"` and `\\\\` may be escaped",
                    });
                }
                None => {
                    return Err(KeyError::BadQuoting {
                        reason: "missing closing quote",
                    });
                }
            },
            Some(b'"') => {
                if iter.next().is_some() {
                    return Err(KeyError::BadQuoting {
                        reason: "characters after the closing quote",
                    });
                }
                return Ok(out);
            }
            Some(c) => out.push(c),
        }
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        assert_eq!(IdempotencyKey::parse(b" abc\t").unwrap().as_str(), "abc");
        assert_eq!(
            IdempotencyKey::parse(br#""a\\b\"c""#).unwrap().as_str(),
            r#"a\b"c"#
        );
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"   "), Err(KeyError::Empty));
        assert!(matches!(
            IdempotencyKey::parse(b"\"abc"),
            Err(KeyError::BadQuoting { .. })
        ));
        assert!(matches!(
            IdempotencyKey::parse(b"\"a\\nb\""),
            Err(KeyError::BadQuoting { .. })
        ));
        assert!(matches!(
            IdempotencyKey::parse(b"\"ab\"c"),
            Err(KeyError::BadQuoting { .. })
        ));
        assert_eq!(
            IdempotencyKey::parse(b"a b"),
            Err(KeyError::InvalidChar {
                byte: b' ',
                position: 1
            })
        );
        assert_eq!(
            IdempotencyKey::parse("é".as_bytes()),
            Err(KeyError::InvalidChar {
                byte: 0xc3,
                position: 0
            })
        );
        let max = vec![b'k'; MAX_KEY_LEN];
        assert!(IdempotencyKey::parse(&max).is_ok());
        let long = vec![b'k'; MAX_KEY_LEN + 1];
        assert_eq!(
            IdempotencyKey::parse(&long),
            Err(KeyError::TooLong { len: 256 })
        );
    }

    #[test]
    fn quoted_keys_with_and_without_escapes() {
        // Quoted keys, with and without escapes, parse per RFC 8941 §4.2.5.
        assert_eq!(
            IdempotencyKey::parse(br#""order-42""#).unwrap().as_str(),
            "order-42"
        );
        assert_eq!(
            IdempotencyKey::parse(br#" "a b" "#),
            Err(KeyError::InvalidChar {
                byte: b' ',
                position: 1
            })
        );
        // An unescaped inner quote, an escape of anything but `"` and `\`, or no closing quote.
        for bad in [&br#""a"b""#[..], br#""a\""#, br#""a\b""#, b"\""] {
            assert!(
                matches!(IdempotencyKey::parse(bad), Err(KeyError::BadQuoting { .. })),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(
            IdempotencyKey::parse(br#""a\"b""#).unwrap().as_str(),
            r#"a"b"#
        );
    }

    #[test]
    fn sf_string_round_trip() {
        let key = IdempotencyKey::parse(br#"we\ird"key"#).unwrap();
        let again = IdempotencyKey::parse(key.to_sf_string().as_bytes()).unwrap();
        assert_eq!(key, again);
    }
}
