//! Request fingerprints: what makes two requests "the same request".

use crate::jcs::Offset;
use sha2::{Digest, Sha256};
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
/// written in canonical order, from a list of 4-byte offsets into the body (8-byte above
/// 4 GiB), never from a copy; JSON is written once in canonical form (see [`canonical_json`]).
/// Both stay within 4 times the body (`tests/alloc_bounds.rs` checks hostile shapes up to
/// 2 MiB). Large bodies are best fingerprinted off the async workers:
/// [`RequestHead::fingerprint_async`](crate::http::RequestHead::fingerprint_async).
///
/// # Versions
/// Every fingerprint carries the [version](Fingerprint::version) of the recipe that made it
/// ([`Fingerprint::VERSION`]), and stores keep it with the record. A stored fingerprint of
/// another version (one this release does not compute, older or newer) never matches a
/// request: the record is a mismatch (422), never a replay.
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
        field(&mut h, input.method.to_ascii_uppercase().as_bytes());
        field(&mut h, input.path.as_bytes());
        match input.query {
            Some(q) => field(&mut h, q.as_bytes()),
            None => h.update([0xff]),
        }
        field(&mut h, media.as_bytes());
        let body = input.body;
        let json = if is_json(&media) {
            canonical_json(body)
        } else {
            None
        };
        if let Some(canon) = json {
            h.update([b'j']);
            field(&mut h, &canon);
        } else if media == "application/x-www-form-urlencoded" {
            h.update([b'f']);
            // The canonical form is never built: its length, then its bytes in order, go
            // straight into the hash.
            if u32::try_from(body.len()).is_ok() {
                hash_form(&mut h, body, &form_order::<u32>(body));
            } else {
                hash_form(&mut h, body, &form_order::<usize>(body));
            }
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
    /// release shipped) read as a version-1 fingerprint, which matches no request. `None`
    /// for anything else.
    ///
    /// ```
    /// use idempotent_core::{Fingerprint, FingerprintInput};
    /// let fp = Fingerprint::compute(&FingerprintInput {
    ///     method: "POST", path: "/v1/charges", query: None, content_type: None, body: b"",
    /// });
    /// assert_eq!(Fingerprint::from_stored(&fp.to_stored()), Some(fp));
    /// let old = Fingerprint::from_stored(&[0; 32]).expect("32 bytes");
    /// assert!(old.version() == 1 && !fp.matches_stored(&old));
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
    /// version and digest. A stored fingerprint of another version is never a match.
    ///
    /// ```
    /// use idempotent_core::Fingerprint;
    /// let request = Fingerprint::from_parts(2, [1; 32]);
    /// assert!(request.matches_stored(&Fingerprint::from_parts(2, [1; 32])));
    /// assert!(!request.matches_stored(&Fingerprint::from_parts(2, [2; 32])));
    /// // A version this release does not compute, older or newer.
    /// assert!(!request.matches_stored(&Fingerprint::from_parts(1, [1; 32])));
    /// assert!(!request.matches_stored(&Fingerprint::from_parts(9, [1; 32])));
    /// ```
    pub fn matches_stored(&self, stored: &Fingerprint) -> bool {
        stored == self
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
fn media_type(content_type: Option<&str>) -> String {
    content_type
        .and_then(|ct| ct.split(';').next())
        .map(|m| m.trim().to_ascii_lowercase())
        .unwrap_or_default()
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
/// still open (8 above 512 MiB), and one copy of an object whose members must be reordered.
///
/// ```
/// use idempotent_core::canonical_json;
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

/// A form body with its pairs decoded, stably sorted by field name and re-encoded: field
/// order does not matter, the order of a repeated field's values does (`a=1&a=2` is not
/// `a=2&a=1`: many servers read repeated fields as an ordered list). Names and values are
/// compared as the bytes they decode to, so bodies that differ only in bytes that are not
/// UTF-8 stay different; empty segments (`a=1&&b=2`) are dropped.
///
/// Working memory, beyond the canonical text it returns: 4 bytes per field (8 above 4 GiB).
///
/// ```
/// use idempotent_core::canonical_form;
/// assert_eq!(canonical_form(b"b=2&a=%41+b&&c"), b"a=A+b&b=2&c=");
/// assert_eq!(canonical_form(b"a=2&z&a=1"), b"a=2&a=1&z=");
/// ```
pub fn canonical_form(body: &[u8]) -> Vec<u8> {
    fn build<O: Offset>(body: &[u8]) -> Vec<u8> {
        let order = form_order::<O>(body);
        let mut out = Vec::with_capacity(usize::try_from(form_len(body)).unwrap_or(0));
        write_form(&mut out, body, &order);
        out
    }
    if u32::try_from(body.len()).is_ok() {
        build::<u32>(body)
    } else {
        build::<usize>(body)
    }
}

/// Where canonical form bytes go: a buffer, a hash, or a count.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Counts the bytes it is given.
struct Count(u64);

impl Sink for Count {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len() as u64;
    }
}

/// Feeds a hash through a buffer, so the many short writes (a `=`, an escape) do not each
/// cost a call into the hash.
struct Hashing<'h> {
    hash: &'h mut Sha256,
    buf: [u8; 4096],
    len: usize,
}

impl Hashing<'_> {
    fn flush(&mut self) {
        self.hash.update(&self.buf[..self.len]);
        self.len = 0;
    }
}

impl Sink for Hashing<'_> {
    fn put(&mut self, bytes: &[u8]) {
        if self.len + bytes.len() > self.buf.len() {
            self.flush();
            if bytes.len() > self.buf.len() {
                self.hash.update(bytes);
                return;
            }
        }
        self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }
}

/// Hashes the canonical form of `body` as a length-prefixed field, without building it:
/// its length is counted first (it does not depend on the order), then its bytes are
/// written in `order`.
fn hash_form<O: Offset>(h: &mut Sha256, body: &[u8], order: &[O]) {
    h.update(form_len(body).to_be_bytes());
    let mut sink = Hashing {
        hash: h,
        buf: [0; 4096],
        len: 0,
    };
    write_form(&mut sink, body, order);
    sink.flush();
}

/// The form's non-empty segments (`name=value` between `&`s).
fn segments(body: &[u8]) -> impl Iterator<Item = &[u8]> {
    body.split(|b| *b == b'&').filter(|s| !s.is_empty())
}

/// The length of the canonical form of `body`.
fn form_len(body: &[u8]) -> u64 {
    let mut count = Count(0);
    for (i, segment) in segments(body).enumerate() {
        count.0 += u64::from(i > 0);
        write_segment(&mut count, segment);
    }
    count.0
}

/// The offsets of the form's non-empty segments, in canonical order: stably sorted by the
/// decoded field name. One offset per field and nothing else: a field's name, value and end
/// are found again in the body when they are needed.
fn form_order<O: Offset>(body: &[u8]) -> Vec<O> {
    let mut order = Vec::with_capacity(segments(body).count());
    order.extend(segments(body).map(|s| O::at(s.as_ptr() as usize - body.as_ptr() as usize)));
    let by_name = |a: &O, b: &O| cmp_form_names(body, a.get(), b.get());
    if !order.is_sorted_by(|a, b| by_name(a, b).is_le()) {
        // Unstable (in place, no buffer), with ties broken by position: the same order as a
        // stable sort, so a repeated field's values keep their order.
        order.sort_unstable_by(|a, b| by_name(a, b).then_with(|| a.cmp(b)));
    }
    order
}

/// Writes the canonical form: the segments at `order`, joined by `&`.
fn write_form<O: Offset>(sink: &mut impl Sink, body: &[u8], order: &[O]) {
    for (i, start) in order.iter().enumerate() {
        if i > 0 {
            sink.put(b"&");
        }
        let rest = &body[start.get()..];
        let end = rest.iter().position(|b| *b == b'&').unwrap_or(rest.len());
        write_segment(sink, &rest[..end]);
    }
}

/// One segment in canonical form: `name=value`, each decoded and encoded again (an absent
/// `=` is written, an absent value is empty); copied as it is when it already is canonical.
fn write_segment(sink: &mut impl Sink, segment: &[u8]) {
    let scan = scan_form_segment(segment);
    if scan.canonical {
        sink.put(segment);
        if scan.eq.is_none() {
            sink.put(b"=");
        }
        return;
    }
    let (name, value) = match scan.eq {
        Some(i) => (&segment[..i], &segment[i + 1..]),
        None => (segment, &b""[..]),
    };
    reencode(sink, name);
    sink.put(b"=");
    reencode(sink, value);
}

/// What one pass over a form segment finds.
struct SegmentScan {
    /// Index of the first `=`.
    eq: Option<usize>,
    /// The segment is exactly the encoding [`form_encode`] would give its decoding.
    canonical: bool,
}

fn scan_form_segment(segment: &[u8]) -> SegmentScan {
    let mut scan = SegmentScan {
        eq: None,
        canonical: true,
    };
    let mut i = 0;
    while i < segment.len() {
        let b = segment[i];
        if !FORM_PLAIN[usize::from(b)] {
            match b {
                b'=' if scan.eq.is_none() => scan.eq = Some(i),
                // A space, as it is encoded.
                b'+' => {}
                b'%' => {
                    // Canonical only as upper-case hex of a byte that must be encoded
                    // (not a plain byte, not a space, which encodes as `+`).
                    let hex = |at: usize| {
                        segment
                            .get(at)
                            .filter(|h| h.is_ascii_digit() || (b'A'..=b'F').contains(*h))
                            .and_then(|h| (*h as char).to_digit(16))
                    };
                    match (hex(i + 1), hex(i + 2)) {
                        (Some(hi), Some(lo)) => {
                            let byte = (hi * 16 + lo) as u8;
                            scan.canonical &= !FORM_PLAIN[usize::from(byte)] && byte != b' ';
                            i += 2;
                        }
                        _ => {
                            scan.canonical = false;
                        }
                    }
                }
                _ => scan.canonical = false,
            }
        }
        i += 1;
    }
    scan
}

/// Compares the decoded names of the segments starting at `a` and `b` (byte order), decoding
/// only from the first byte where their spellings differ or one of them needs decoding.
fn cmp_form_names(body: &[u8], a: usize, b: usize) -> std::cmp::Ordering {
    let (x, y) = (&body[a..], &body[b..]);
    let same = x
        .iter()
        .zip(y)
        .position(|(p, q)| p != q || !FORM_LITERAL[usize::from(*p)])
        .unwrap_or(x.len().min(y.len()));
    FormName(&x[same..]).cmp(FormName(&y[same..]))
}

/// The decoded bytes of a field name: from the start of a segment up to its `=` or `&` (or
/// the body's end); `+` is a space, `%XX` a byte, a `%` without two hex digits itself.
struct FormName<'b>(&'b [u8]);

impl Iterator for FormName<'_> {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        match b {
            b'=' | b'&' => None,
            b'+' => {
                self.0 = rest;
                Some(b' ')
            }
            b'%' => match (hex(rest.first()), hex(rest.get(1))) {
                // Hex digits are never `=` or `&`: an escape never crosses the name's end.
                (Some(hi), Some(lo)) => {
                    self.0 = &rest[2..];
                    Some(hi << 4 | lo)
                }
                _ => {
                    self.0 = rest;
                    Some(b'%')
                }
            },
            _ => {
                self.0 = rest;
                Some(b)
            }
        }
    }
}

/// The value of a hex digit (either case).
fn hex(digit: Option<&u8>) -> Option<u8> {
    digit
        .and_then(|d| (*d as char).to_digit(16))
        .map(|d| d as u8)
}

/// Writes the `application/x-www-form-urlencoded` decoding of `input` encoded again as
/// `form_urlencoded::byte_serialize` does it (alphanumerics and `*-._` as they are, space as
/// `+`, every other byte as `%XX` in upper-case hex), in one pass: runs of bytes that decode
/// and encode to themselves are copied as they are.
fn reencode(sink: &mut impl Sink, input: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut rest = input;
    while !rest.is_empty() {
        let run = rest
            .iter()
            .position(|b| !FORM_PLAIN[usize::from(*b)])
            .unwrap_or(rest.len());
        if run > 0 {
            sink.put(&rest[..run]);
            rest = &rest[run..];
            continue;
        }
        let (decoded, used) = match rest[0] {
            b'+' => (b' ', 1),
            b'%' => match (hex(rest.get(1)), hex(rest.get(2))) {
                (Some(hi), Some(lo)) => (hi << 4 | lo, 3),
                _ => (b'%', 1),
            },
            other => (other, 1),
        };
        rest = &rest[used..];
        if FORM_PLAIN[usize::from(decoded)] {
            sink.put(&[decoded]);
        } else if decoded == b' ' {
            sink.put(b"+");
        } else {
            sink.put(&[
                b'%',
                HEX[usize::from(decoded >> 4)],
                HEX[usize::from(decoded & 0xf)],
            ]);
        }
    }
}

/// Bytes form encoding leaves as they are.
static FORM_PLAIN: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || matches!(c, b'*' | b'-' | b'.' | b'_');
        b += 1;
    }
    table
};

/// Bytes that decode to themselves inside a field name and do not end it: all but `+`, `%`,
/// `=` and `&`.
static FORM_LITERAL: [bool; 256] = {
    let mut table = [true; 256];
    table[b'+' as usize] = false;
    table[b'%' as usize] = false;
    table[b'=' as usize] = false;
    table[b'&' as usize] = false;
    table
};

#[cfg(test)]
mod tests {
    use super::*;

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

    /// The form canonicalisation before it was rewritten without allocations (the oracle):
    /// what is hashed must not change.
    fn canonical_form_reference(body: &[u8]) -> Vec<u8> {
        let decode = |input: &[u8]| -> Vec<u8> {
            let plus: Vec<u8> = input
                .iter()
                .map(|b| if *b == b'+' { b' ' } else { *b })
                .collect();
            percent_encoding::percent_decode(&plus).collect()
        };
        let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = body
            .split(|b| *b == b'&')
            .filter(|segment| !segment.is_empty())
            .map(|segment| match segment.iter().position(|b| *b == b'=') {
                Some(i) => (decode(&segment[..i]), decode(&segment[i + 1..])),
                None => (decode(segment), Vec::new()),
            })
            .collect();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out = Vec::new();
        for (i, (name, value)) in pairs.iter().enumerate() {
            if i > 0 {
                out.push(b'&');
            }
            out.extend(form_urlencoded::byte_serialize(name).flat_map(str::bytes));
            out.push(b'=');
            out.extend(form_urlencoded::byte_serialize(value).flat_map(str::bytes));
        }
        out
    }

    proptest::proptest! {
        #[test]
        fn form_canonicalisation_is_unchanged(
            body in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::sample::select(b"&=+%aAzZ09*-._ ~/".to_vec()),
                    proptest::sample::select(b"0123456789abcdefABCDEF".to_vec()),
                    proptest::prelude::any::<u8>(),
                ],
                0..64,
            )
        ) {
            proptest::prop_assert_eq!(canonical_form(&body), canonical_form_reference(&body));
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

    /// Records of another version, including the 32-byte layout of version 1 (never shipped),
    /// are read and never match: a mismatch, not a replay, and not a panic.
    #[test]
    fn other_versions_never_match() {
        let request = fp(Some("application/json"), b"{}");
        let digest = *request.digest();
        for stored in [
            Fingerprint::from_stored(&digest).expect("32 bytes"),
            Fingerprint::from_parts(1, digest),
            Fingerprint::from_parts(3, digest),
            Fingerprint::from_parts(0, digest),
        ] {
            assert!(!request.matches_stored(&stored), "{stored:?}");
        }
        assert!(
            request
                .matches_stored(&Fingerprint::from_stored(&request.to_stored()).expect("33 bytes"))
        );
    }

    /// Bodies past the `u32` offsets' range use `usize` ones: the same canonical form.
    #[test]
    fn wide_offsets_give_the_same_form() {
        for body in [
            &b"b=2&a=1&a=%41+x&c&&=z&%7e=~"[..],
            b"&a&a&b&a",
            b"",
            b"z&y&x",
        ] {
            let order = form_order::<usize>(body);
            let mut wide = Vec::new();
            write_form(&mut wide, body, &order);
            assert_eq!(wide, canonical_form(body));
            assert_eq!(wide, canonical_form_reference(body));
            assert_eq!(form_len(body), wide.len() as u64);
        }
    }
}
