//! Request fingerprints: what makes two requests "the same request".

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
/// # Versions
/// Every fingerprint carries the [version](Fingerprint::version) of the recipe that made it
/// ([`Fingerprint::VERSION`] for new ones), and stores keep it with the record. A stored
/// fingerprint is compared under its own version: a request fingerprinted with
/// [`Fingerprint::compute_with_route`] also carries its version-1 digest (which hashed the
/// route template instead of the path), so records written before the upgrade still replay
/// for the same request and still refuse a different one. A stored version the server cannot
/// recompute (a newer release's) is never assumed to match: it is a mismatch (422).
#[derive(Clone, Copy)]
pub struct Fingerprint {
    version: u8,
    digest: [u8; 32],
    /// The same request under version 1, when the route template was known.
    v1: Option<[u8; 32]>,
}

/// Equal when version and digest are: the version-1 companion is not part of the identity.
impl PartialEq for Fingerprint {
    fn eq(&self, other: &Self) -> bool {
        self.version == other.version && self.digest == other.digest
    }
}

impl Eq for Fingerprint {}

impl std::hash::Hash for Fingerprint {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.version.hash(state);
        self.digest.hash(state);
    }
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
    /// The version of the recipe [`Fingerprint::compute`] uses (2: the concrete path; 1 hashed
    /// the route template).
    pub const VERSION: u8 = 2;

    /// Computes the fingerprint of a request. Never fails: bodies that do not parse as their
    /// media type are hashed raw.
    pub fn compute(input: &FingerprintInput<'_>) -> Self {
        Self::compute_versions(input, None)
    }

    /// [`Fingerprint::compute`], plus the request's version-1 digest over `route`, the matched
    /// route template, so that records written by version 1 are compared as version 1 compared
    /// them instead of being refused after an upgrade. Only for templates without parameters
    /// (`/v1/charges`): version 1 could not tell `/orders/1/refund` from `/orders/2/refund`,
    /// so its records on parameterised routes cannot be matched safely and stay mismatches.
    ///
    /// ```
    /// use idempotent_core::{Fingerprint, FingerprintInput};
    /// let input = |path| FingerprintInput {
    ///     method: "POST", path, query: None, content_type: None, body: b"",
    /// };
    /// let request = Fingerprint::compute_with_route(&input("/v1/charges"), "/v1/charges");
    /// assert_eq!(request, Fingerprint::compute(&input("/v1/charges")));
    /// let stored_by_v1 = request.legacy().expect("version 1 digest");
    /// assert_eq!(stored_by_v1.version(), 1);
    /// assert!(request.matches_stored(&stored_by_v1));
    /// let refund = Fingerprint::compute_with_route(&input("/orders/1/refund"), "/orders/{id}/refund");
    /// assert_eq!(refund.legacy(), None);
    /// ```
    pub fn compute_with_route(input: &FingerprintInput<'_>, route: &str) -> Self {
        Self::compute_versions(input, Some(route).filter(|r| !r.contains('{')))
    }

    /// The current fingerprint, and the version-1 digest over `v1_route` if given. The body is
    /// canonicalised once: version 1 treated everything but forms the same way.
    fn compute_versions(input: &FingerprintInput<'_>, v1_route: Option<&str>) -> Self {
        let media = media_type(input.content_type);
        let (kind, body) = canonical_body(&media, input.body, canonical_form);
        let digest_of =
            |tag: &[u8], path: &str, body: &[u8]| digest(tag, input, path, &media, kind, body);
        Fingerprint {
            version: Self::VERSION,
            digest: digest_of(b"idempotent-fingerprint-v2", input.path, &body),
            v1: v1_route.map(|route| {
                if kind == BodyKind::Form {
                    digest_of(
                        b"idempotent-fingerprint-v1",
                        route,
                        &canonical_form_v1(input.body),
                    )
                } else {
                    digest_of(b"idempotent-fingerprint-v1", route, &body)
                }
            }),
        }
    }

    /// The request's version-1 fingerprint, when it was computed
    /// ([`Fingerprint::compute_with_route`]).
    pub fn legacy(&self) -> Option<Fingerprint> {
        self.v1.map(|digest| Fingerprint::from_parts(1, digest))
    }

    /// A fingerprint from its version and digest.
    pub fn from_parts(version: u8, digest: [u8; 32]) -> Self {
        Fingerprint {
            version,
            digest,
            v1: None,
        }
    }

    /// Rebuilds a fingerprint from its stored form ([`Fingerprint::to_stored`]): a version byte
    /// followed by the 32-byte digest, or 32 bytes alone for a version-1 record. `None` for
    /// anything else.
    ///
    /// ```
    /// use idempotent_core::{Fingerprint, FingerprintInput};
    /// let fp = Fingerprint::compute(&FingerprintInput {
    ///     method: "POST", path: "/v1/charges", query: None, content_type: None, body: b"",
    /// });
    /// assert_eq!(Fingerprint::from_stored(&fp.to_stored()), Some(fp));
    /// assert_eq!(Fingerprint::from_stored(&[0; 32]).map(|f| f.version()), Some(1));
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

    /// Whether a record whose stored fingerprint is `stored` belongs to this request: compared
    /// under the stored version (this version's digest, or the version-1 digest when this
    /// request carries one); a version this request cannot be compared under is not a match.
    ///
    /// ```
    /// use idempotent_core::Fingerprint;
    /// let request = Fingerprint::from_parts(2, [1; 32]);
    /// assert!(request.matches_stored(&Fingerprint::from_parts(2, [1; 32])));
    /// assert!(!request.matches_stored(&Fingerprint::from_parts(2, [2; 32])));
    /// // No version-1 digest to compare with, or a version this release does not know.
    /// assert!(!request.matches_stored(&Fingerprint::from_parts(1, [1; 32])));
    /// assert!(!request.matches_stored(&Fingerprint::from_parts(9, [1; 32])));
    /// ```
    pub fn matches_stored(&self, stored: &Fingerprint) -> bool {
        if stored.version == self.version {
            stored.digest == self.digest
        } else if stored.version == 1 {
            self.v1 == Some(stored.digest)
        } else {
            false
        }
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

/// SHA-256 over the tagged, length-prefixed fields (`path` is the path as received, or the
/// route template for version 1).
fn digest(
    tag: &[u8],
    input: &FingerprintInput<'_>,
    path: &str,
    media: &str,
    kind: BodyKind,
    body: &[u8],
) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(tag);
    field(&mut h, input.method.to_ascii_uppercase().as_bytes());
    field(&mut h, path.as_bytes());
    match input.query {
        Some(q) => field(&mut h, q.as_bytes()),
        None => h.update([0xff]),
    }
    field(&mut h, media.as_bytes());
    h.update([match kind {
        BodyKind::Json => b'j',
        BodyKind::Form => b'f',
        BodyKind::Raw => b'r',
    }]);
    field(&mut h, body);
    h.finalize().into()
}

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

fn canonical_body<'b>(
    media: &str,
    body: &'b [u8],
    form: fn(&[u8]) -> Vec<u8>,
) -> (BodyKind, Cow<'b, [u8]>) {
    if is_json(media) {
        if let Some(canon) = canonical_json(body) {
            return (BodyKind::Json, Cow::Owned(canon));
        }
    } else if media == "application/x-www-form-urlencoded" {
        return (BodyKind::Form, Cow::Owned(form(body)));
    }
    (BodyKind::Raw, Cow::Borrowed(body))
}

/// RFC 8785 (JCS) canonical form of a JSON text, or `None` when it does not parse.
///
/// Numbers are IEEE 754 doubles, as JCS requires (integers beyond ±2^53 become the nearest
/// double); of members with the same name the last one wins, as in `JSON.parse`; texts
/// nested deeper than 127 arrays and objects, numbers that overflow a double, lone
/// surrogates and anything else `serde_json` refuses are not JSON. Written in one pass
/// without building a tree, and tested byte for byte against `serde_jcs` as the oracle.
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
pub fn canonical_form(body: &[u8]) -> Vec<u8> {
    /// One field. Its name as decoded is `decoded[name.0..name.1]`, or `body[..]` when
    /// `name_in_body`; `prefix` is that name's first 8 bytes, big-endian, zero-padded, which
    /// decides most comparisons without touching the bytes. When the segment is already in
    /// canonical encoding (`raw`), it is copied as it is; otherwise the decoded value
    /// (`decoded[name.1..value_end]`) is encoded again.
    struct Pair<'b> {
        prefix: u64,
        name: (usize, usize),
        name_in_body: bool,
        value_end: usize,
        raw: Option<(&'b [u8], bool)>,
    }
    let mut decoded = Vec::new();
    let mut pairs = Vec::new();
    for segment in body.split(|b| *b == b'&').filter(|s| !s.is_empty()) {
        let scan = scan_form_segment(segment);
        let (name, value) = match scan.eq {
            Some(i) => (&segment[..i], &segment[i + 1..]),
            None => (segment, &b""[..]),
        };
        let offset = name.as_ptr() as usize - body.as_ptr() as usize;
        let (name_at, name_in_body) = if scan.name_plain {
            ((offset, offset + name.len()), true)
        } else {
            let start = decoded.len();
            form_decode_into(&mut decoded, name);
            ((start, decoded.len()), false)
        };
        let value_end = if scan.canonical {
            name_at.1
        } else {
            if name_in_body {
                decoded.extend_from_slice(name);
            }
            let mid = decoded.len();
            form_decode_into(&mut decoded, value);
            let end = decoded.len();
            pairs.push(Pair {
                prefix: 0,
                name: (mid - (name_at.1 - name_at.0), mid),
                name_in_body: false,
                value_end: end,
                raw: None,
            });
            continue;
        };
        pairs.push(Pair {
            prefix: 0,
            name: name_at,
            name_in_body,
            value_end,
            raw: Some((segment, scan.eq.is_none())),
        });
    }
    let name_of = |p: &Pair<'_>| {
        let source = if p.name_in_body { body } else { &decoded[..] };
        &source[p.name.0..p.name.1]
    };
    for pair in &mut pairs {
        let mut prefix = [0u8; 8];
        let name = name_of(pair);
        let head = &name[..name.len().min(8)];
        prefix[..head.len()].copy_from_slice(head);
        pair.prefix = u64::from_be_bytes(prefix);
    }
    let by_name = |a: &Pair<'_>, b: &Pair<'_>| {
        a.prefix
            .cmp(&b.prefix)
            .then_with(|| name_of(a).cmp(name_of(b)))
    };
    if !pairs.is_sorted_by(|a, b| by_name(a, b).is_le()) {
        // Stable: a repeated field's values keep their order.
        pairs.sort_by(by_name);
    }
    let mut out = Vec::with_capacity(body.len() + body.len() / 4);
    for (i, pair) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(b'&');
        }
        match pair.raw {
            Some((segment, add_eq)) => {
                out.extend_from_slice(segment);
                if add_eq {
                    out.push(b'=');
                }
            }
            None => {
                form_encode(&mut out, &decoded[pair.name.0..pair.name.1]);
                out.push(b'=');
                form_encode(&mut out, &decoded[pair.name.1..pair.value_end]);
            }
        }
    }
    out
}

/// What one pass over a form segment finds.
struct SegmentScan {
    /// Index of the first `=`.
    eq: Option<usize>,
    /// The name decodes to itself (no `+`, no `%`).
    name_plain: bool,
    /// The segment is exactly the encoding [`form_encode`] would give its decoding.
    canonical: bool,
}

fn scan_form_segment(segment: &[u8]) -> SegmentScan {
    let mut scan = SegmentScan {
        eq: None,
        name_plain: true,
        canonical: true,
    };
    let mut i = 0;
    while i < segment.len() {
        let b = segment[i];
        if !FORM_PLAIN[usize::from(b)] {
            match b {
                b'=' if scan.eq.is_none() => scan.eq = Some(i),
                b'+' => scan.name_plain &= scan.eq.is_some(),
                b'%' => {
                    scan.name_plain &= scan.eq.is_some();
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
                            // A `%` that is not an escape decodes to itself; the name is then
                            // not plain either way, which only costs a decode.
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

/// Appends the `application/x-www-form-urlencoded` decoding of `input` to `out`: `+` is a
/// space, `%XX` a byte (a `%` without two hex digits stays as it is).
fn form_decode_into(out: &mut Vec<u8>, input: &[u8]) {
    let mut rest = input;
    while let Some(at) = rest.iter().position(|b| *b == b'+' || *b == b'%') {
        out.extend_from_slice(&rest[..at]);
        if rest[at] == b'+' {
            out.push(b' ');
            rest = &rest[at + 1..];
            continue;
        }
        let hex = |i: usize| rest.get(at + i).and_then(|h| (*h as char).to_digit(16));
        if let (Some(hi), Some(lo)) = (hex(1), hex(2)) {
            out.push((hi * 16 + lo) as u8);
            rest = &rest[at + 3..];
        } else {
            out.push(b'%');
            rest = &rest[at + 1..];
        }
    }
    out.extend_from_slice(rest);
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

/// `application/x-www-form-urlencoded` encoding as `form_urlencoded::byte_serialize` does it
/// (alphanumerics and `*-._` as they are, space as `+`, every other byte as `%XX` in
/// upper-case hex), a run of plain bytes at a time.
fn form_encode(out: &mut Vec<u8>, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut rest = bytes;
    while !rest.is_empty() {
        let run = rest
            .iter()
            .position(|b| !FORM_PLAIN[usize::from(*b)])
            .unwrap_or(rest.len());
        out.extend_from_slice(&rest[..run]);
        if let Some(&b) = rest.get(run) {
            if b == b' ' {
                out.push(b'+');
            } else {
                out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
            }
            rest = &rest[run + 1..];
        } else {
            rest = &[];
        }
    }
}

/// Version 1's form canonicalisation (decoded as text, every pair sorted), kept only to compare
/// records written by version 1.
fn canonical_form_v1(body: &[u8]) -> Vec<u8> {
    let mut pairs: Vec<(String, String)> = form_urlencoded::parse(body)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    pairs.sort();
    form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
        .into_bytes()
}

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

    /// Version 1 hashed the route template; a request on a route without parameters carries
    /// that digest so version-1 records are compared as version 1 compared them; on a route
    /// with parameters it cannot be told which object a version-1 record was for.
    #[test]
    fn version_one_records_are_compared_as_version_one() {
        let input = |path, body: &'static [u8]| FingerprintInput {
            method: "POST",
            path,
            query: None,
            content_type: Some("application/x-www-form-urlencoded"),
            body,
        };
        let one = Fingerprint::compute_with_route(&input("/refunds", b"b=2&a=1"), "/refunds");
        let stored = one.legacy().expect("v1");
        assert!(one.matches_stored(&stored));
        // Another body is another request under version 1 too.
        let other = Fingerprint::compute_with_route(&input("/refunds", b"a=2"), "/refunds");
        assert!(!other.matches_stored(&stored));
        // Without the route, a version-1 record cannot be compared: not a match.
        assert!(!Fingerprint::compute(&input("/refunds", b"b=2&a=1")).matches_stored(&stored));
        // Parameterised routes: no version-1 digest, so version-1 records are mismatches.
        let param =
            Fingerprint::compute_with_route(&input("/orders/1/refund", b""), "/orders/{id}/refund");
        assert_eq!(param.legacy(), None);
        // The version-1 digest is exactly what version 1 computed (its recipe, pinned).
        let pinned = Fingerprint::compute_with_route(&input("/orders", b"b=2&a=1"), "/orders");
        assert_eq!(
            pinned.legacy().expect("v1").to_hex(),
            "886f4c312e85f0e0d8fa4078433e201fefbe36c6bdac1e065672d2f0683ea16c",
            "computed by version 1's recipe (commit 41e9ea1)"
        );
    }
}
