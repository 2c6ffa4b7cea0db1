//! Request fingerprints: what makes two requests "the same request".

pub use crate::form::canonical_form;
use crate::form::hash_form;
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::fmt;

/// SHA-256 over a request's method, concrete path, query, body media type and (canonicalised)
/// body, tagged with the version of that recipe.
///
/// The path is the one the request was sent to (`/orders/1/refund`, not the route template
/// `/orders/{id}/refund`): path parameters are part of the operation, so one key used for
/// `/orders/1/refund` and then `/orders/2/refund` is a mismatch, never a replay. Path and
/// query hash exactly as received, without percent or slash normalisation.
///
/// JSON bodies (`application/json` or any `+json` type) are canonicalised per RFC 8785 (JCS),
/// so key order and whitespace do not change the fingerprint; form bodies
/// (`application/x-www-form-urlencoded`) are canonicalised by a stable sort on the field
/// name, which keeps the order of a repeated field's values (`a=1&a=2` differs from
/// `a=2&a=1`); other bodies, and JSON that does not parse, hash raw.
///
/// # Cost
/// Time is linear in the body (plus the sort of out-of-order form fields or JSON members), and
/// the working memory a small multiple of it, whatever its shape: a form is hashed as it is
/// written in canonical order, from one sort record per field pointing into the body and a
/// bit per byte (at most 3⅛ times the body below 4 GiB, 4 times above, see
/// [`canonical_form`]), never from a copy; JSON is written once
/// in canonical form (see [`canonical_json`]), into buffers each thread keeps from one
/// fingerprint to the next, so once a thread has made one, a small JSON body costs no
/// allocation: a thread keeps at most about 50 KiB (a buffer that grew larger for one body is
/// freed afterwards), blocking-pool threads that fingerprinted large bodies included (so at
/// most about 50 KiB times the runtime's threads in all).
/// Both stay within 4 times the body (`tests/alloc_bounds.rs` checks hostile shapes up to
/// 2 MiB). Large bodies are best fingerprinted off the async workers:
/// [`RequestHead::fingerprint_async`](crate::http::RequestHead::fingerprint_async).
///
/// # Versions
/// Every fingerprint carries the [version](Fingerprint::version) of the recipe that made it
/// ([`Fingerprint::VERSION`]), and stores keep it with the record. A stored fingerprint of
/// another version (one this release does not compute, older or newer: written before an
/// upgrade that changed the recipe, or by a newer instance in a rolling deploy) cannot be
/// compared with this version's digest, so its record is matched by key alone: a retry
/// within its ttl replays it (or finds it in progress) and never gets 422 for the upgrade,
/// nor runs again. Only that window, one ttl after an upgrade, cannot tell a key reused for
/// another request from a retry.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    version: u8,
    digest: [u8; 32],
}

/// The parts of a request that go into its [`Fingerprint`].
#[derive(Debug, Clone, Copy)]
pub struct FingerprintInput<'a> {
    /// HTTP method (compared case-insensitively).
    pub method: &'a str,
    /// The request's path as received (`/v1/charges/ch_1/refunds`), without the query:
    /// never the matched route template, and not normalised.
    pub path: &'a str,
    /// The query string without `?`, if any.
    pub query: Option<&'a str>,
    /// The `Content-Type` header, if any (parameters such as `charset` are ignored).
    pub content_type: Option<&'a str>,
    /// The request body.
    pub body: &'a [u8],
}

/// How a body was hashed: part of the fingerprint, so a JSON body never equals a raw body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyKind {
    /// Canonical JSON (RFC 8785).
    Json,
    /// Sorted form pairs.
    Form,
    /// Raw bytes.
    Raw,
}

impl Fingerprint {
    /// The version of the recipe [`Fingerprint::compute`] uses.
    pub const VERSION: u8 = 2;

    /// Computes the fingerprint of a request. Never fails: bodies that do not parse as their
    /// media type are hashed raw.
    pub fn compute(input: &FingerprintInput<'_>) -> Self {
        let media = media_type(input.content_type);
        let mut h = Sha256::new();
        h.update(b"idempotent-fingerprint-v2");
        field(&mut h, ascii_case(input.method, true).as_bytes());
        field(&mut h, input.path.as_bytes());
        match input.query {
            Some(q) => field(&mut h, q.as_bytes()),
            None => h.update([0xff]),
        }
        field(&mut h, media.as_bytes());
        let body = input.body;
        // A JSON body's canonical text is hashed where it was written (this thread's reused
        // buffers); a body that is not JSON after all is hashed raw.
        let json = is_json(&media)
            && crate::jcs::with_canonical(body, |canon| {
                h.update([b'j']);
                field(&mut h, canon);
            })
            .is_some();
        if json {
            // Hashed above.
        } else if media == "application/x-www-form-urlencoded" {
            h.update([b'f']);
            // The canonical form is never built: its length, then its bytes in order, go
            // straight into the hash.
            hash_form(&mut h, body);
        } else {
            h.update([b'r']);
            field(&mut h, body);
        }
        Fingerprint {
            version: Self::VERSION,
            digest: h.finalize().into(),
        }
    }

    /// A fingerprint from its version and digest.
    pub fn from_parts(version: u8, digest: [u8; 32]) -> Self {
        Fingerprint { version, digest }
    }

    /// Rebuilds a fingerprint from its stored form ([`Fingerprint::to_stored`]): a version byte
    /// followed by the 32-byte digest. 32 bytes alone (the layout of version 1, which no
    /// release shipped) read as a version-1 fingerprint, matched by key alone like any other
    /// version. `None` for anything else.
    ///
    /// ```
    /// use idempotent_core::{fingerprint::Fingerprint, fingerprint::FingerprintInput};
    /// let fp = Fingerprint::compute(&FingerprintInput {
    ///     method: "POST", path: "/v1/charges", query: None, content_type: None, body: b"",
    /// });
    /// assert_eq!(Fingerprint::from_stored(&fp.to_stored()), Some(fp));
    /// let old = Fingerprint::from_stored(&[0; 32]).expect("32 bytes");
    /// assert!(old.version() == 1 && fp.matches_stored(&old));
    /// assert_eq!(Fingerprint::from_stored(b"short"), None);
    /// ```
    pub fn from_stored(bytes: &[u8]) -> Option<Self> {
        match bytes.len() {
            32 => Some(Fingerprint::from_parts(1, bytes.try_into().ok()?)),
            33 => Some(Fingerprint::from_parts(
                bytes[0],
                bytes[1..].try_into().ok()?,
            )),
            _ => None,
        }
    }

    /// The stored form: the version byte, then the digest.
    pub fn to_stored(&self) -> [u8; 33] {
        let mut out = [0; 33];
        out[0] = self.version;
        out[1..].copy_from_slice(&self.digest);
        out
    }

    /// The recipe's version (see the type's docs).
    pub fn version(&self) -> u8 {
        self.version
    }

    /// The 32 digest bytes.
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Whether a record whose stored fingerprint is `stored` belongs to this request: the same
    /// digest under the same version; a stored fingerprint of another version cannot be
    /// compared, so its record is matched by key alone (see "Versions" above).
    ///
    /// ```
    /// use idempotent_core::fingerprint::Fingerprint;
    /// let request = Fingerprint::from_parts(2, [1; 32]);
    /// assert!(request.matches_stored(&Fingerprint::from_parts(2, [1; 32])));
    /// assert!(!request.matches_stored(&Fingerprint::from_parts(2, [2; 32])));
    /// // A version this release does not compute, older or newer: matched by key alone.
    /// assert!(request.matches_stored(&Fingerprint::from_parts(1, [7; 32])));
    /// assert!(request.matches_stored(&Fingerprint::from_parts(9, [7; 32])));
    /// ```
    pub fn matches_stored(&self, stored: &Fingerprint) -> bool {
        stored.version != self.version || stored.digest == self.digest
    }

    /// Lower-case hex of the digest.
    pub fn to_hex(&self) -> String {
        use fmt::Write;
        let mut s = String::with_capacity(64);
        for b in self.digest {
            let _ = write!(s, "{b:02x}");
        }
        s
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint(v{}:{})", self.version, self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A length-prefixed field.
fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

/// The media type's essence, lower-cased, without parameters (`application/json`).
fn media_type(content_type: Option<&str>) -> Cow<'_, str> {
    content_type
        .and_then(|ct| ct.split(';').next())
        .map_or(Cow::Borrowed(""), |m| ascii_case(m.trim(), false))
}

/// `text` in ASCII upper (or lower) case, borrowed when it already is (no allocation for
/// `POST` or `application/json`).
fn ascii_case(text: &str, upper: bool) -> Cow<'_, str> {
    let other_case = |b: &u8| {
        if upper {
            b.is_ascii_lowercase()
        } else {
            b.is_ascii_uppercase()
        }
    };
    if !text.as_bytes().iter().any(other_case) {
        Cow::Borrowed(text)
    } else if upper {
        Cow::Owned(text.to_ascii_uppercase())
    } else {
        Cow::Owned(text.to_ascii_lowercase())
    }
}

fn is_json(media: &str) -> bool {
    media == "application/json" || (media.starts_with("application/") && media.ends_with("+json"))
}

/// RFC 8785 (JCS) canonical form of a JSON text, or `None` when it does not parse.
///
/// Numbers are IEEE 754 doubles, as JCS requires (integers beyond ±2^53 become the nearest
/// double); of members with the same name the last one wins, as in `JSON.parse`; texts
/// nested deeper than 127 arrays and objects, numbers that overflow a double, lone
/// surrogates and anything else `serde_json` refuses are not JSON. Written in one pass
/// without building a tree, and tested byte for byte against `serde_jcs` as the oracle.
///
/// Working memory, beyond the canonical text it returns: 4 bytes per member of the objects
/// still open (8 above 512 MiB), one copy of an object whose members must be reordered, and
/// up to 1 KiB to sort small objects.
///
/// ```
/// use idempotent_core::fingerprint::canonical_json;
/// let canon = canonical_json(br#"{ "b": [1.0, 2e3, "\u00e9"], "a": {"y": null, "x": true} }"#);
/// let canon = String::from_utf8(canon.expect("JSON")).expect("UTF-8");
/// assert_eq!(canon, r#"{"a":{"x":true,"y":null},"b":[1,2000,"é"]}"#);
/// assert_eq!(canonical_json(br#"{"a":1,"a":2}"#).as_deref(), Some(&br#"{"a":2}"#[..]));
/// assert_eq!(canonical_json(b"[1e400]"), None);
/// assert_eq!(canonical_json(b"{"), None);
/// ```
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    crate::jcs::canonicalize(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::form::tests::canonical_form_reference;

    fn canon(s: &str) -> String {
        String::from_utf8(canonical_json(s.as_bytes()).unwrap()).unwrap()
    }

    /// RFC 8785 §3.2.2 / Appendix: the published example and number serialisations.
    #[test]
    fn rfc8785_examples() {
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50,
                      2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        let expected = "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"€$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";
        assert_eq!(canon(input), expected);
    }

    /// RFC 8785 Appendix B: IEEE 754 doubles and their JCS text.
    #[test]
    fn rfc8785_numbers() {
        for (input, want) in [
            ("0", "0"),
            ("-0", "0"),
            ("5e-324", "5e-324"),
            ("-5e-324", "-5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("9007199254740992", "9007199254740992"),
            ("9007199254740993", "9007199254740992"),
            ("-9007199254740993", "-9007199254740992"),
            ("295147905179352830000", "295147905179352830000"),
            ("1e21", "1e+21"),
            ("999999999999999900000", "999999999999999900000"),
            ("0.000001", "0.000001"),
            ("0.0000001", "1e-7"),
            ("4.5", "4.5"),
            ("333333333.3333333", "333333333.3333333"),
        ] {
            assert_eq!(canon(&format!("[{input}]")), format!("[{want}]"), "{input}");
        }
    }

    /// RFC 8785 §3.2.3: properties sorted by UTF-16 code units.
    #[test]
    fn rfc8785_sorting() {
        let input = r#"{"\u20ac":"Euro Sign","\r":"Carriage Return","\ufb33":"Hebrew Letter Dalet With Dagesh","1":"One","\ud83d\ude00":"Emoji: Grinning Face","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis"}"#;
        let out = canon(input);
        let order: Vec<&str> = [
            "Carriage Return",
            "One",
            "Control",
            "Latin Small",
            "Euro Sign",
            "Emoji",
            "Hebrew",
        ]
        .to_vec();
        let mut last = 0;
        for name in order {
            let at = out.find(name).unwrap();
            assert!(at > last, "{name} out of order in {out}");
            last = at;
        }
    }

    fn fp(ct: Option<&str>, body: &[u8]) -> Fingerprint {
        Fingerprint::compute(&FingerprintInput {
            method: "POST",
            path: "/r",
            query: None,
            content_type: ct,
            body,
        })
    }

    #[test]
    fn kinds_and_fields() {
        let form = Some("application/x-www-form-urlencoded");
        assert_eq!(fp(form, b"a=1&b=2"), fp(form, b"b=2&a=1"));
        assert_eq!(fp(form, b"a=%41"), fp(form, b"a=A"));
        assert_ne!(fp(form, b"a=1&b=2"), fp(form, b"a=2&b=1"));
        // A repeated field's values keep their order; other fields move freely around them.
        assert_ne!(
            fp(form, b"amount=1&amount=100"),
            fp(form, b"amount=100&amount=1")
        );
        assert_eq!(fp(form, b"a=1&b=x&a=2"), fp(form, b"b=x&a=1&a=2"));
        assert_ne!(fp(form, b"a=1&b=x&a=2"), fp(form, b"b=x&a=2&a=1"));
        // Bytes that are not UTF-8 are compared as bytes, not replaced.
        assert_ne!(fp(form, b"sig=%FF%00"), fp(form, b"sig=%FE%00"));
        assert_ne!(fp(form, b"\xff=1"), fp(form, b"\xfe=1"));
        assert_eq!(fp(form, b"a=%41+b"), fp(form, b"a=A%20b"));
        assert_eq!(fp(form, b"a=1&&b=2&"), fp(form, b"b=2&a=1"));
        // Raw bodies are byte-exact.
        assert_ne!(
            fp(Some("text/plain"), b"a b"),
            fp(Some("text/plain"), b"a  b")
        );
        // JSON that fails to parse hashes raw and differs from the same bytes as text/plain.
        assert_ne!(
            fp(Some("application/json"), b"{"),
            fp(Some("text/plain"), b"{")
        );
        // Vendor +json types canonicalise.
        let pj = Some("application/problem+json");
        assert_eq!(fp(pj, b"{\"a\":1, \"b\":2}"), fp(pj, b"{\"b\":2,\"a\":1}"));
        // A JSON body never equals the form body with the same bytes.
        assert_ne!(fp(Some("application/json"), b"1"), fp(form, b"1"));
        let base = FingerprintInput {
            method: "post",
            path: "/r",
            query: Some("x=1"),
            content_type: None,
            body: b"",
        };
        let upper = FingerprintInput {
            method: "POST",
            ..base
        };
        assert_eq!(Fingerprint::compute(&base), Fingerprint::compute(&upper));
        // The media type's case does not count either, nor its parameters.
        assert_eq!(
            fp(Some(" Application/JSON ; charset=UTF-8"), b"{\"a\":1}"),
            fp(Some("application/json"), b"{\"a\":1}")
        );
        let other_path = FingerprintInput { path: "/s", ..base };
        assert_ne!(
            Fingerprint::compute(&base),
            Fingerprint::compute(&other_path)
        );
        // Path parameters and encodings are part of the request, as received.
        let order = |path| Fingerprint::compute(&FingerprintInput { path, ..base });
        assert_ne!(order("/orders/1/refund"), order("/orders/2/refund"));
        assert_ne!(order("/orders/1/refund"), order("/orders/%31/refund"));
        assert_ne!(order("/orders/1/refund"), order("/orders//1/refund"));
        let no_query = FingerprintInput {
            query: None,
            ..base
        };
        let empty_query = FingerprintInput {
            query: Some(""),
            ..base
        };
        assert_ne!(
            Fingerprint::compute(&no_query),
            Fingerprint::compute(&empty_query)
        );
        // Length prefixes: moving bytes between fields changes the hash.
        let a = FingerprintInput {
            path: "/ab",
            query: Some("c"),
            ..base
        };
        let b = FingerprintInput {
            path: "/a",
            query: Some("bc"),
            ..base
        };
        assert_ne!(Fingerprint::compute(&a), Fingerprint::compute(&b));
        assert_eq!(Fingerprint::compute(&base).to_hex().len(), 64);
        assert_eq!(Fingerprint::compute(&base).version(), Fingerprint::VERSION);
    }

    /// Version 2's digests, computed before its form hashing was rewritten to stream: stored
    /// records hold them, so they must never change.
    #[test]
    fn version_two_digests_are_pinned() {
        let form = Some("application/x-www-form-urlencoded");
        for (content_type, body, hex) in [
            (
                form,
                &b"b=2&a=1&a=%41+x&c&&=z&%7e=~"[..],
                "72f4b24d735fbe09a1b3d182e1780125178bf037cfb0cc7bf07180bce475a236",
            ),
            (
                form,
                b"",
                "f462496cb7f98f308e60f4f4455cca9d43e23eaa1c7ff099b186bfee668a9bc8",
            ),
            (
                Some("application/x-www-form-urlencoded; charset=utf-8"),
                b"z=%ff&y=1=2&x=%4",
                "96c0e793ec43376f89a0563e4557d5b48dc6b94ca9cf804d2fe0e1512842a182",
            ),
            (
                Some("application/json"),
                br#"{"b":[1.0,2e3],"a":{"y":null,"x":true}}"#,
                "f710f43bca76c3cc4905350c5cd0ceb7b0361909e7a84c0148505403b40e97a5",
            ),
            (
                Some("application/json"),
                b"{",
                "31a5ca02595170e063046eb86449afd65396ec512fdba9469feb53f4ac0bc24f",
            ),
            (
                Some("text/plain"),
                b"hello",
                "2242aa7e9ad461881d2089a231d9d7a3fb001a6c64b1f9ee6e6a5f052f278b3f",
            ),
            (
                None,
                b"",
                "d43db4b14ea64e12b9ae01433a4f55eee140639c7fbe5b2866dc85d7339e3f00",
            ),
        ] {
            let fp = Fingerprint::compute(&FingerprintInput {
                method: "post",
                path: "/r",
                query: Some("q=1"),
                content_type,
                body,
            });
            assert_eq!(fp.to_hex(), hex, "{content_type:?} {body:?}");
        }
    }

    /// Version 2's recipe over a body already canonical, as it was computed before forms were
    /// hashed without being built.
    fn digest_v2(input: &FingerprintInput<'_>, kind: u8, canonical: &[u8]) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"idempotent-fingerprint-v2");
        field(&mut h, input.method.to_ascii_uppercase().as_bytes());
        field(&mut h, input.path.as_bytes());
        match input.query {
            Some(q) => field(&mut h, q.as_bytes()),
            None => h.update([0xff]),
        }
        field(&mut h, media_type(input.content_type).as_bytes());
        h.update([kind]);
        field(&mut h, canonical);
        h.finalize().into()
    }

    proptest::proptest! {
        /// The streamed form hash is the hash of the canonical form as it was built before.
        #[test]
        fn form_fingerprint_is_unchanged(
            body in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::sample::select(b"&=+%aAzZ09*-._ ~/".to_vec()),
                    proptest::sample::select(b"0123456789abcdefABCDEF".to_vec()),
                    proptest::prelude::any::<u8>(),
                ],
                0..200,
            )
        ) {
            let input = FingerprintInput {
                method: "POST",
                path: "/r",
                query: None,
                content_type: Some("application/x-www-form-urlencoded"),
                body: &body,
            };
            let want = digest_v2(&input, b'f', &canonical_form_reference(&body));
            proptest::prop_assert_eq!(*Fingerprint::compute(&input).digest(), want);
        }
    }

    /// Forms past the streamed hash's 4 KiB buffer hash as their canonical form: many short
    /// writes across the buffer's edge, a segment longer than the whole buffer written as it
    /// is, and one written escape by escape.
    #[test]
    fn long_forms_hash_as_their_canonical_form() {
        let mut body = String::new();
        for i in 0..600 {
            body.push_str(&format!("f{}=%7e+v[{i}]&", 600 - i));
        }
        body.push_str(&"z".repeat(5_000));
        body.push_str(&format!("&long={}&", "%41b".repeat(3_000)));
        body.push_str(&"a%2Fb".repeat(2_000));
        let input = FingerprintInput {
            method: "POST",
            path: "/r",
            query: None,
            content_type: Some("application/x-www-form-urlencoded"),
            body: body.as_bytes(),
        };
        let want = digest_v2(&input, b'f', &canonical_form_reference(body.as_bytes()));
        assert_eq!(*Fingerprint::compute(&input).digest(), want);
    }

    /// Records of another version, including the 32-byte layout of version 1 (never shipped),
    /// are read and matched by key alone (their digest cannot be compared), never a panic.
    #[test]
    fn other_versions_match_by_key_alone() {
        let request = fp(Some("application/json"), b"{}");
        let digest = *request.digest();
        for stored in [
            Fingerprint::from_stored(&digest).expect("32 bytes"),
            Fingerprint::from_parts(1, digest),
            Fingerprint::from_parts(3, [9; 32]),
            Fingerprint::from_parts(0, [0; 32]),
        ] {
            assert!(request.matches_stored(&stored), "{stored:?}");
        }
        assert!(
            request
                .matches_stored(&Fingerprint::from_stored(&request.to_stored()).expect("33 bytes"))
        );
        // This version's digest of another request is another request.
        assert!(!request.matches_stored(&Fingerprint::from_parts(Fingerprint::VERSION, [9; 32])));
    }
}
