//! Form bodies (`application/x-www-form-urlencoded`) in canonical form, for the fingerprint:
//! fields stably sorted by decoded name, each re-encoded one way, written into a buffer
//! ([`canonical_form`]) or straight into the fingerprint's hash (`hash_form`), without a
//! copy of the body (see [`crate::fingerprint::Fingerprint`]'s "Cost").

use crate::jcs::Offset;
use sha2::{Digest, Sha256};

/// A form body with its pairs decoded, stably sorted by field name and re-encoded: field
/// order does not matter, the order of a repeated field's values does (`a=1&a=2` is not
/// `a=2&a=1`: many servers read repeated fields as an ordered list). Names and values are
/// compared as the bytes they decode to, so bodies that differ only in bytes that are not
/// UTF-8 stay different; empty segments (`a=1&&b=2`) are dropped.
///
/// Working memory, beyond the canonical text it returns: one sort record per field, at most
/// 3 times the body, and a bit per byte of the body (which segments are already in canonical
/// form, so they are copied without a second look); above 4 GiB, an 8-byte offset per field
/// (at most 4 times the body) and no bits. A record is 16 bytes (the first 11 decoded bytes of the name and the
/// field's offset, so that most comparisons are one integer comparison) when fields average
/// 16/3 bytes or more, 8 bytes (3 name bytes) from 8/3, and 4 bytes for tinier fields (1
/// name byte below 4 MiB, or the offset alone, at most 2 times the body as a field takes 2
/// bytes).
///
/// ```
/// use idempotent_core::fingerprint::canonical_form;
/// assert_eq!(canonical_form(b"b=2&a=%41+b&&c"), b"a=A+b&b=2&c=");
/// assert_eq!(canonical_form(b"a=2&z&a=1"), b"a=2&a=1&z=");
/// ```
pub fn canonical_form(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    write_form(&mut out, body);
    out
}

/// Where canonical form bytes go: a buffer or a hash.
trait Sink {
    /// Told the canonical form's length before its first byte.
    fn begin(&mut self, len: u64);
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn begin(&mut self, len: u64) {
        self.reserve_exact(usize::try_from(len).unwrap_or(0));
    }

    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Feeds a hash through a buffer, so the many short writes (a `=`, an escape) do not each
/// cost a call into the hash. The form is a length-prefixed field: its length goes first.
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

    /// [`Sink::put`] of bytes that do not fit in what is left of the buffer: the buffer is
    /// hashed first, and bytes longer than the whole buffer are hashed as they are.
    #[inline(never)]
    fn put_past_the_buffer(&mut self, bytes: &[u8]) {
        self.flush();
        if bytes.len() > self.buf.len() {
            self.hash.update(bytes);
        } else {
            self.buf[..bytes.len()].copy_from_slice(bytes);
            self.len = bytes.len();
        }
    }
}

impl Sink for Hashing<'_> {
    fn begin(&mut self, len: u64) {
        self.put(&len.to_be_bytes());
    }

    /// Inline, so that the many writes of a byte or three (an `&`, an escape) are a store
    /// into the buffer, not a call.
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        match self.buf.get_mut(self.len..self.len + bytes.len()) {
            Some(room) => {
                room.copy_from_slice(bytes);
                self.len += bytes.len();
            }
            None => self.put_past_the_buffer(bytes),
        }
    }
}

/// Hashes the canonical form of `body` as a length-prefixed field, without building it.
pub(crate) fn hash_form(h: &mut Sha256, body: &[u8]) {
    let mut sink = Hashing {
        hash: h,
        buf: [0; 4096],
        len: 0,
    };
    write_form(&mut sink, body);
    sink.flush();
}

/// How many non-empty segments (`name=value` between `&`s) the form has.
fn count_segments(body: &[u8]) -> usize {
    // The segments' first bytes: a byte that is not `&`, first or after an `&`. Written as
    // a count over pairs of bytes, which compiles to vector code.
    let first = usize::from(body.first().is_some_and(|b| *b != b'&'));
    first
        + body
            .iter()
            .zip(body.iter().skip(1))
            .filter(|(a, b)| **a == b'&' && **b != b'&')
            .count()
}

/// The form's non-empty segments: the offset of each, with what [`scan_form_segment`]
/// finds in it. Marks in `as_is` each segment that is written as it is.
fn scanned_segments<'b>(
    body: &'b [u8],
    as_is: &'b mut AsIs,
) -> impl Iterator<Item = (usize, SegmentScan)> + 'b {
    let mut at = 0;
    std::iter::from_fn(move || {
        while body.get(at) == Some(&b'&') {
            at += 1;
        }
        let scan = scan_form_segment(body.get(at..).filter(|rest| !rest.is_empty())?);
        let start = at;
        if scan.canonical && scan.eq.is_some() {
            as_is.mark(start);
        }
        at += scan.len;
        Some((start, scan))
    })
}

/// One bit per byte of a form body, set where a segment starts that is written as it is
/// (canonical, with its `=`): the second pass copies such a segment up to its `&` without
/// scanning it again. An eighth of the body, or nothing ([`AsIs::none`]: every segment is
/// scanned again).
struct AsIs(Vec<u64>);

impl AsIs {
    fn new(body: &[u8]) -> Self {
        AsIs(vec![0; body.len() / 64 + 1])
    }

    /// Marks nothing.
    fn none() -> Self {
        AsIs(Vec::new())
    }

    fn mark(&mut self, at: usize) {
        if let Some(word) = self.0.get_mut(at / 64) {
            *word |= 1 << (at % 64);
        }
    }

    fn marked(&self, at: usize) -> bool {
        self.0
            .get(at / 64)
            .is_some_and(|word| word & 1 << (at % 64) != 0)
    }
}

/// Writes the canonical form of `body` (its length first, see [`Sink::begin`]): its
/// segments stably sorted by decoded field name, joined by `&`.
///
/// The sort runs on one small record per field and nothing else: a field's name, value and
/// end are found again in the body when they are needed (a segment marked in [`AsIs`] by
/// its end alone). Each record holds the first
/// decoded bytes of its field's name with its offset (a [`FormKey`]), so that most
/// comparisons are one integer comparison, as wide as the records stay within 3 times the
/// body: [`Key16`] when fields average 16/3 bytes or more, [`Key8`] from 8/3, else [`Key4`]
/// (at most twice the body, as a field takes 2 bytes or more). Past [`Key4`]'s 4 MiB, tiny
/// fields are sorted on their 4-byte offsets alone, comparing the names in the body, and
/// above 4 GiB every form is, on 8-byte offsets.
fn write_form(sink: &mut impl Sink, body: &[u8]) {
    let fields = count_segments(body);
    let (count, len) = (fields as u64, body.len() as u64);
    if u32::try_from(body.len()).is_err() {
        write_sorted_offsets::<usize>(sink, body, fields);
    } else if 16 * count <= 3 * len {
        write_sorted_keys::<Key16>(sink, body, fields);
    } else if 8 * count <= 3 * len {
        write_sorted_keys::<Key8>(sink, body, fields);
    } else if body.len() <= Key4::OFFSET_MASK as usize {
        write_sorted_keys::<Key4>(sink, body, fields);
    } else {
        write_sorted_offsets::<u32>(sink, body, fields);
    }
}

/// The length of the canonical form of the segment `scan` was taken of.
fn canonical_len(scan: &SegmentScan) -> u64 {
    scan.len as u64 + scan.grown - scan.shrunk + u64::from(scan.eq.is_none())
}

/// Something that says where a segment starts in the body: an offset, or a sort key that
/// carries one.
trait Start: Copy {
    fn start(self) -> usize;
}

impl<O: Offset> Start for O {
    fn start(self) -> usize {
        self.get()
    }
}

/// Writes the segments starting at `order`, joined by `&`.
fn write_in_order<S: Start>(sink: &mut impl Sink, body: &[u8], order: &[S], as_is: &AsIs) {
    for (i, start) in order.iter().enumerate() {
        if i > 0 {
            sink.put(b"&");
        }
        let rest = &body[start.start()..];
        if as_is.marked(start.start()) {
            sink.put(&rest[..memchr::memchr(b'&', rest).unwrap_or(rest.len())]);
        } else {
            let scan = scan_form_segment(rest);
            write_segment(sink, &rest[..scan.len], &scan);
        }
    }
}

/// [`write_form`] on offsets of type `O`, for a form of `fields` non-empty segments.
fn write_sorted_offsets<O: Offset>(sink: &mut impl Sink, body: &[u8], fields: usize) {
    let mut order = Vec::with_capacity(fields);
    let mut len = fields.saturating_sub(1) as u64;
    // Offsets of 8 bytes (above 4 GiB) may take 4 times the body already, the bound: no
    // bitset on top of them.
    let mut as_is = if size_of::<O>() < 8 {
        AsIs::new(body)
    } else {
        AsIs::none()
    };
    order.extend(scanned_segments(body, &mut as_is).map(|(start, scan)| {
        len += canonical_len(&scan);
        O::at(start)
    }));
    sink.begin(len);
    let by_name = |a: &O, b: &O| cmp_form_names(body, a.get(), b.get());
    if !order.is_sorted_by(|a, b| by_name(a, b).is_le()) {
        // Unstable (in place, no buffer), with ties broken by position: the same order as a
        // stable sort, so a repeated field's values keep their order.
        order.sort_unstable_by(|a, b| by_name(a, b).then_with(|| a.cmp(b)));
    }
    write_in_order(sink, body, &order, &as_is);
}

/// [`write_form`] on keys of type `K`, for a form below 4 GiB of `fields` non-empty
/// segments.
fn write_sorted_keys<K: FormKey>(sink: &mut impl Sink, body: &[u8], fields: usize) {
    let mut keys = Vec::with_capacity(fields);
    let mut len = fields.saturating_sub(1) as u64;
    let mut as_is = AsIs::new(body);
    keys.extend(scanned_segments(body, &mut as_is).map(|(start, scan)| {
        len += canonical_len(&scan);
        K::new(&body[start..], 0, start)
    }));
    sink.begin(len);
    sort_keys(body, &mut keys, 0, &as_is);
    write_in_order(sink, body, &keys, &as_is);
}

/// A sort key: `BYTES` decoded bytes of a field's name from some depth on (zero-padded), how
/// many there are (`BYTES + 1` when the name goes on past them), and the segment's offset,
/// packed in one integer in that order of significance. Keys taken at the same depth of
/// names that agree before it compare as the names do, ties broken by position; except two
/// keys whose bytes are equal and whose names both go on, which [`FormKey::ties`] tells.
///
/// Zero padding is exact: where a name has ended and the other goes on with a zero byte,
/// the counts decide, and the shorter name comes first as it should.
trait FormKey: Start + Ord {
    /// How many decoded name bytes a key holds.
    const BYTES: usize;

    /// The key of the segment at `start` (below 4 GiB) on the decoded bytes from `depth` on
    /// of the rest of its name in `name`: the body from the start of the name or from an
    /// escape's boundary within it. The rest must be at least `depth` bytes long.
    fn new(name: &[u8], depth: usize, start: usize) -> Self;

    /// Whether `self` and `other` hold the same bytes of names that both go on past them:
    /// then the keys do not order the names, the bytes after them do.
    fn ties(self, other: Self) -> bool;
}

/// The bytes `depth..depth + N` of the decoded name that starts `rest` (`N` at most 15),
/// big-endian, zero-padded, followed by a byte counting them (`N + 1` when the name goes on
/// past them).
fn name_window<const N: usize>(rest: &[u8], depth: usize) -> u128 {
    let head = &rest[..rest.len().min(depth + N + 1)];
    let plain = head
        .iter()
        .position(|b| !FORM_LITERAL[usize::from(*b)])
        .unwrap_or(head.len());
    // 16 bytes from the window's start (only the first `count` of them are the name's).
    let (word, count) = if plain == head.len() || matches!(head[plain], b'=' | b'&') {
        // No escape up to the name's end, or for long enough: its bytes are its decoding.
        let count = plain.saturating_sub(depth);
        let word = match rest.get(depth..depth + 16) {
            Some(word) => word.try_into().map_or(0, u128::from_be_bytes),
            None => {
                let mut word = [0u8; 16];
                let bytes = rest.get(depth..).unwrap_or_default();
                word[..bytes.len()].copy_from_slice(bytes);
                u128::from_be_bytes(word)
            }
        };
        (word, count)
    } else {
        // Decoded, as `FormName` does it, in a loop of its own: this runs once a field and
        // again for each depth its key ties.
        let mut word = [0u8; 16];
        let (mut at, mut decoded) = (0, 0);
        while decoded < depth + N + 1 {
            let (b, used) = match rest.get(at) {
                None | Some(b'=' | b'&') => break,
                Some(b'+') => (b' ', 1),
                Some(b'%') => match (hex(rest.get(at + 1)), hex(rest.get(at + 2))) {
                    (Some(hi), Some(lo)) => (hi << 4 | lo, 3),
                    _ => (b'%', 1),
                },
                Some(b) => (*b, 1),
            };
            if let Some(slot) = decoded.checked_sub(depth).and_then(|i| word.get_mut(i)) {
                *slot = b;
            }
            at += used;
            decoded += 1;
        }
        (u128::from_be_bytes(word), decoded.saturating_sub(depth))
    };
    // The first `N` bytes of the window, those past the name's end zero, then the count.
    let held = count.min(N);
    let bytes = word.checked_shr(8 * (16 - held) as u32).unwrap_or(0) << (8 * (N - held));
    bytes << 8 | count as u128
}

/// A [`FormKey`] of 4 bytes for bodies below 4 MiB: 1 name byte, its count (2 bits), a
/// 22-bit offset.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key4(u32);

impl Key4 {
    /// The offset's bits.
    const OFFSET_MASK: u32 = (1 << 22) - 1;
}

impl Start for Key4 {
    fn start(self) -> usize {
        (self.0 & Self::OFFSET_MASK) as usize
    }
}

impl FormKey for Key4 {
    const BYTES: usize = 1;

    fn new(name: &[u8], depth: usize, start: usize) -> Self {
        let window = name_window::<{ Self::BYTES }>(name, depth) as u32;
        // The count (at most 2) in 2 bits, right under the byte.
        Key4((window >> 8) << 24 | (window & 3) << 22 | start as u32)
    }

    fn ties(self, other: Self) -> bool {
        self.0 >> 22 == other.0 >> 22 && (self.0 >> 22) & 3 > Self::BYTES as u32
    }
}

/// A [`FormKey`] of 8 bytes: 3 name bytes, their count, a 32-bit offset.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key8(u64);

impl Start for Key8 {
    fn start(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }
}

impl FormKey for Key8 {
    const BYTES: usize = 3;

    fn new(name: &[u8], depth: usize, start: usize) -> Self {
        let window = name_window::<{ Self::BYTES }>(name, depth) as u64;
        Key8(window << 32 | start as u64)
    }

    fn ties(self, other: Self) -> bool {
        self.0 >> 32 == other.0 >> 32 && (self.0 >> 32) as u8 as usize > Self::BYTES
    }
}

/// A [`FormKey`] of 16 bytes: 11 name bytes, their count, a 32-bit offset.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key16(u128);

impl Start for Key16 {
    fn start(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }
}

impl FormKey for Key16 {
    const BYTES: usize = 11;

    fn new(name: &[u8], depth: usize, start: usize) -> Self {
        Key16(name_window::<{ Self::BYTES }>(name, depth) << 32 | start as u128)
    }

    fn ties(self, other: Self) -> bool {
        self.0 >> 32 == other.0 >> 32 && (self.0 >> 32) as u8 as usize > Self::BYTES
    }
}

/// How deep into the names keys are taken again for fields whose keys tie; past it, the
/// names themselves are compared.
const KEY_DEPTH: usize = 48;

/// Sorts `keys`, taken at `depth` of names that agree before it, into canonical order: on
/// the keys, then each run of keys that tie on keys taken further on.
///
/// Names of segments in canonical form that agree on their first `depth` decoded bytes
/// also agree on how those are spelled (each byte has one canonical spelling), so their
/// keys further on are taken from where the first of them has spelled them, without
/// decoding the bytes before again.
fn sort_keys<K: FormKey>(body: &[u8], keys: &mut [K], depth: usize, as_is: &AsIs) {
    if !keys.is_sorted() {
        keys.sort_unstable();
    }
    let mut rest = keys;
    while let Some((first, _)) = rest.split_first() {
        let run = 1 + rest[1..].iter().take_while(|k| first.ties(**k)).count();
        let (tied, after) = rest.split_at_mut(run);
        if run > 1 {
            let deeper = depth + K::BYTES;
            if deeper < KEY_DEPTH {
                let spelled = tied
                    .iter()
                    .map(|key| key.start())
                    .find(|start| as_is.marked(*start))
                    .map(|first| spelling_len(&body[first..], deeper));
                for key in tied.iter_mut() {
                    let start = key.start();
                    *key = match spelled {
                        Some(len) if as_is.marked(start) => K::new(&body[start + len..], 0, start),
                        _ => K::new(&body[start..], deeper, start),
                    };
                }
                sort_keys(body, tied, deeper, as_is);
            } else {
                tied.sort_unstable_by(|a, b| {
                    cmp_form_names(body, a.start(), b.start())
                        .then_with(|| a.start().cmp(&b.start()))
                });
            }
        }
        rest = after;
    }
}

/// One segment in canonical form: `name=value`, each decoded and encoded again (an absent
/// `=` is written, an absent value is empty); copied as it is when it already is canonical.
fn write_segment(sink: &mut impl Sink, segment: &[u8], scan: &SegmentScan) {
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
    /// The segment's length: up to the first `&`, or the end.
    len: usize,
    /// Index of the first `=`.
    eq: Option<usize>,
    /// The segment is exactly the encoding [`reencode`] would give its decoding.
    canonical: bool,
    /// How many bytes its canonical form ([`write_segment`]) gains over the segment, less
    /// an absent `=`: 2 for each byte that is written as an escape and was not one...
    grown: u64,
    /// ... and 2 for each escape that is written as one byte (a plain byte or a space).
    shrunk: u64,
}

/// Scans the segment at the start of `rest` (up to its first `&`).
fn scan_form_segment(rest: &[u8]) -> SegmentScan {
    let mut scan = SegmentScan {
        len: rest.len(),
        eq: None,
        canonical: true,
        grown: 0,
        shrunk: 0,
    };
    let mut i = 0;
    while i < rest.len() {
        let b = rest[i];
        if !FORM_PLAIN[usize::from(b)] {
            match b {
                b'&' => {
                    scan.len = i;
                    break;
                }
                b'=' if scan.eq.is_none() => scan.eq = Some(i),
                // A space, as it is encoded.
                b'+' => {}
                b'%' => {
                    // Hex digits are never `&`: an escape never crosses the segment's end.
                    match (hex(rest.get(i + 1)), hex(rest.get(i + 2))) {
                        (Some(hi), Some(lo)) => {
                            let byte = hi << 4 | lo;
                            let one_byte = FORM_PLAIN[usize::from(byte)] || byte == b' ';
                            scan.shrunk += 2 * u64::from(one_byte);
                            // Canonical only as upper-case hex of a byte that must be
                            // encoded (not a plain byte, not a space, which encodes as `+`).
                            scan.canonical &= !one_byte
                                && upper_hex(rest.get(i + 1)).is_some()
                                && upper_hex(rest.get(i + 2)).is_some();
                            i += 2;
                        }
                        // A `%` of its own, written `%25`.
                        _ => {
                            scan.canonical = false;
                            scan.grown += 2;
                        }
                    }
                }
                // A raw space, written `+`.
                b' ' => scan.canonical = false,
                // Any other byte (a second `=` included) is written as an escape.
                _ => {
                    scan.canonical = false;
                    scan.grown += 2;
                }
            }
        }
        i += 1;
    }
    scan
}

/// How many bytes of `name` spell its first `decoded` decoded bytes (it has that many).
fn spelling_len(name: &[u8], decoded: usize) -> usize {
    let mut at = 0;
    for _ in 0..decoded {
        at += match name.get(at) {
            Some(b'%') if hex(name.get(at + 1)).is_some() && hex(name.get(at + 2)).is_some() => 3,
            _ => 1,
        };
    }
    at
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
        .map(|d| HEX_DIGIT[usize::from(*d)])
        .filter(|v| *v & HEX_INVALID == 0)
        .map(|v| v & 0xf)
}

/// The value of an upper-case hex digit.
fn upper_hex(digit: Option<&u8>) -> Option<u8> {
    digit
        .map(|d| HEX_DIGIT[usize::from(*d)])
        .filter(|v| *v < 0x10)
}

/// [`HEX_DIGIT`]'s mark of a byte that is not a hex digit.
const HEX_INVALID: u8 = 0x80;

/// Each byte's value as a hex digit: `0..=15` for `0-9` and `A-F`, that plus `0x10` for
/// `a-f`, [`HEX_INVALID`] for the rest.
static HEX_DIGIT: [u8; 256] = {
    let mut table = [HEX_INVALID; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = match c {
            b'0'..=b'9' => c - b'0',
            b'A'..=b'F' => c - b'A' + 10,
            b'a'..=b'f' => (c - b'a' + 10) | 0x10,
            _ => HEX_INVALID,
        };
        b += 1;
    }
    table
};

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
pub(crate) mod tests {
    use super::*;

    /// The form canonicalisation before it was rewritten without allocations (the oracle):
    /// what is hashed must not change.
    pub(crate) fn canonical_form_reference(body: &[u8]) -> Vec<u8> {
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

    /// Every way of ordering a form (8-byte offsets past 4 GiB, 4-byte ones past 4 MiB of
    /// tiny fields, 4-, 8- and 16-byte keys) gives the canonical form, and the length
    /// announced first is its length.
    fn every_order(body: &[u8]) -> [(&'static str, Vec<u8>, u64); 5] {
        /// The length [`Sink::begin`] is told, and the bytes.
        #[derive(Default)]
        struct Announced(u64, Vec<u8>);
        impl Sink for Announced {
            fn begin(&mut self, len: u64) {
                self.0 = len;
            }
            fn put(&mut self, bytes: &[u8]) {
                self.1.extend_from_slice(bytes);
            }
        }
        let fields = count_segments(body);
        let run = |f: fn(&mut Announced, &[u8], usize)| {
            let mut out = Announced::default();
            f(&mut out, body, fields);
            (out.1, out.0)
        };
        let (wide, wide_len) = run(write_sorted_offsets::<usize>);
        let (offsets, offsets_len) = run(write_sorted_offsets::<u32>);
        let (key4, key4_len) = run(write_sorted_keys::<Key4>);
        let (key8, key8_len) = run(write_sorted_keys::<Key8>);
        let (key16, key16_len) = run(write_sorted_keys::<Key16>);
        [
            ("usize offsets", wide, wide_len),
            ("u32 offsets", offsets, offsets_len),
            ("4-byte keys", key4, key4_len),
            ("8-byte keys", key8, key8_len),
            ("16-byte keys", key16, key16_len),
        ]
    }

    /// What the scan finds in one segment: its end, its `=`, whether it is written as it
    /// is, and the canonical length counted on the way, against what is written.
    #[test]
    fn segment_scans() {
        for (segment, len, eq, canonical, written) in [
            (&b"%C3%A9=x&b"[..], 8, Some(6), true, &b"%C3%A9=x"[..]),
            (b"%c3%a9", 6, None, false, b"%C3%A9="),
            (b"%", 1, None, false, b"%25="),
            (b"a==b", 4, Some(1), false, b"a=%3Db"),
            (b"%20=%41", 7, Some(3), false, b"+=A"),
            (b"a b=+", 5, Some(3), false, b"a+b=+"),
            (b"%4g=%4", 6, Some(3), false, b"%254g=%254"),
            (b"%2A=%26", 7, Some(3), false, b"*=%26"),
            (b"k=\\xff", 6, Some(1), false, b"k=%5Cxff"),
            (b"k=\xff", 3, Some(1), false, b"k=%FF"),
            (b"=", 1, Some(0), true, b"="),
        ] {
            let scan = scan_form_segment(segment);
            assert_eq!(
                (scan.len, scan.eq, scan.canonical),
                (len, eq, canonical),
                "{segment:?}"
            );
            let mut out = Vec::new();
            write_segment(&mut out, &segment[..scan.len], &scan);
            assert_eq!(out, written, "{segment:?}");
            assert_eq!(canonical_len(&scan), written.len() as u64, "{segment:?}");
        }
    }

    #[test]
    fn every_order_gives_the_same_form() {
        let long = "customer%5Baddress%5D%5Bline1%5D";
        for body in [
            &b"b=2&a=1&a=%41+x&c&&=z&%7e=~"[..],
            b"&a&a&b&a",
            b"%",
            b"a=%",
            b"%4g=%4&%2=%",
            b"",
            b"&&",
            b"z&y&x",
            b"a%00&a&a%00%00=1&a=2&%00&=&a%00b",
            b"abc&abcd&abc%00&abcd=1&ab&abc",
            format!("{long}=1&{long}0=2&{long}=3&{long}%00=4&{long}+=5&{long}").as_bytes(),
            "x".repeat(100).as_bytes(),
            format!("{a}1&{a}&{a}0&{a}&{a}%30", a = "y".repeat(60)).as_bytes(),
        ] {
            let want = canonical_form_reference(body);
            assert_eq!(canonical_form(body), want, "{body:?}");
            for (order, form, len) in every_order(body) {
                assert_eq!(form, want, "{order}: {body:?}");
                assert_eq!(len, want.len() as u64, "{order}: {body:?}");
            }
        }
    }

    /// Every depth around the key boundaries (1, 3, 11 and 48 decoded bytes), with the shared
    /// bytes spelled canonically and not, escapes of reserved bytes before them, and segments
    /// copied as they are next to ones written again.
    #[test]
    fn every_order_at_key_boundaries() {
        let heads = [
            "", "%3D", "%3d", "%26", "%25", "%", "+", "%20", "%2B", "%C3%A9", "%c3%A9", "s", "%73",
        ];
        let tails = ["", "s", "t", "%00", "%3D", "+", "%74"];
        let values = ["=v", "", "=%7e", "="];
        let depths = [
            0, 1, 2, 3, 4, 9, 10, 11, 12, 20, 21, 22, 23, 32, 33, 34, 43, 44, 45, 46, 47, 48, 49,
            50, 56,
        ];
        for shared in depths {
            let mut segments = Vec::new();
            for head in heads {
                for tail in tails {
                    for value in values {
                        segments.push(format!("{head}{}{tail}{value}", "s".repeat(shared)));
                    }
                }
            }
            let forward = segments.join("&");
            segments.reverse();
            for body in [forward, segments.join("&")] {
                let want = canonical_form_reference(body.as_bytes());
                assert_eq!(canonical_form(body.as_bytes()), want, "{body}");
                for (order, form, len) in every_order(body.as_bytes()) {
                    assert_eq!(form, want, "{order}: {body}");
                    assert_eq!(len, want.len() as u64, "{order}: {body}");
                }
            }
        }
    }

    proptest::proptest! {
        /// Names that share long decoded prefixes, spelled with and without escapes, so that
        /// keys tie and are taken again deeper.
        #[test]
        fn every_order_on_shared_prefixes(
            fields in proptest::collection::vec(
                (
                    proptest::collection::vec(
                        proptest::sample::select(vec!["a", "%61", "b", "+", "%20", "%00", ""]),
                        0..6,
                    ),
                    0..60usize,
                    proptest::collection::vec(
                        proptest::sample::select(vec!["a", "%61", "b", "%00", "&", "="]),
                        0..3,
                    ),
                ),
                0..40,
            )
        ) {
            let mut body = String::new();
            for (head, shared, tail) in fields {
                body.push_str(&head.concat());
                body.push_str(&"s".repeat(shared));
                body.push_str(&tail.concat());
                body.push('&');
            }
            let want = canonical_form_reference(body.as_bytes());
            for (order, form, len) in every_order(body.as_bytes()) {
                proptest::prop_assert_eq!(&form, &want, "{}: {:?}", order, body);
                proptest::prop_assert_eq!(len, want.len() as u64, "{}: {:?}", order, body);
            }
        }

        /// Any bytes, on every ordering.
        #[test]
        fn every_order_on_any_bytes(
            body in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::sample::select(b"&=+%aAzZ09*-._ ~/".to_vec()),
                    proptest::sample::select(b"0123456789abcdefABCDEF".to_vec()),
                    proptest::prelude::any::<u8>(),
                ],
                0..200,
            )
        ) {
            let want = canonical_form_reference(&body);
            for (order, form, len) in every_order(&body) {
                proptest::prop_assert_eq!(&form, &want, "{}: {:?}", order, body);
                proptest::prop_assert_eq!(len, want.len() as u64, "{}: {:?}", order, body);
            }
        }
    }
}
