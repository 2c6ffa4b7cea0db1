//! RFC 8785 (JSON Canonicalization Scheme) in one pass: the input is parsed and the canonical
//! form written as it goes, without building a tree. Objects are the only place that needs a
//! second look: their members are written in input order, then rewritten in sorted order
//! (UTF-16 code units of the decoded names) when the input was not already sorted.
//!
//! What is accepted is exactly what `serde_json` accepts (RFC 8259, no trailing commas, no
//! comments, no lone surrogates, at most 127 nested arrays and objects), and the output is
//! byte-for-byte what `serde_jcs` writes for `serde_json`'s parse of the same text; the tests
//! check both against those crates as the oracle. Behaviours this module decides:
//!
//! - **Duplicate member names**: the last one wins, as `JSON.parse` (whose serialisation JCS
//!   is defined by), `serde_json::Value` and fingerprint version 2 before this writer do.
//!   `{"a":1,"a":2}` canonicalises to `{"a":2}`.
//! - **Numbers** are IEEE 754 doubles, as JCS requires: integers beyond ±2^53 become the
//!   nearest double; a number that overflows a double (`1e400`) makes the text invalid.
//! - **Bounds**: nesting deeper than [`MAX_DEPTH`] makes the text invalid (no recursion past
//!   it, so hostile input cannot exhaust the stack). The output is at most a small constant
//!   times the input (the worst case is a short number such as `1e20` written out in full,
//!   21 bytes for 4; any other text is at most as long as its input). The working memory
//!   beyond the output is one offset (4 bytes, 8 above 512 MiB of input) per member of the
//!   objects still open, each member taking at least 5 bytes of input, and one copy of an
//!   object whose members need reordering, plus 1 KiB at most for sorting small objects:
//!   about 3 times the input at most, output included, unless numbers grow. An object of at
//!   most 64 members is sorted as integer keys that hold the first 12 bytes of each name and
//!   the member's index (names are compared only where their keys tie), with each member's
//!   end known from where the next began; a larger one is sorted in place, comparing names
//!   without allocating at the cost of their common prefix and finding each member's end
//!   again in the text. An object whose members need reordering is copied once, so a text
//!   nested `d` objects deep, each out of order, is copied at most `d` (≤ 127) times.

use std::cell::Cell;
use std::cmp::Ordering;

/// Deepest nesting of arrays and objects accepted (`serde_json`'s limit).
pub(crate) const MAX_DEPTH: usize = 127;

/// An offset into a buffer: `u32` where the buffer is known to stay below 4 GiB, `usize`
/// beyond (half the memory per entry where it matters: one per form field or JSON member).
pub(crate) trait Offset: Copy + Ord {
    /// The offset `at` (below 4 GiB for `u32`: the caller chooses the type by the size).
    fn at(at: usize) -> Self;
    /// The offset as an index.
    fn get(self) -> usize;
}

impl Offset for u32 {
    fn at(at: usize) -> Self {
        u32::try_from(at).unwrap_or(u32::MAX)
    }

    fn get(self) -> usize {
        self as usize
    }
}

impl Offset for usize {
    fn at(at: usize) -> Self {
        at
    }

    fn get(self) -> usize {
        self
    }
}

/// The canonical form of `input`, or `None` when it is not a JSON text (see the module docs).
pub(crate) fn canonicalize(input: &[u8]) -> Option<Vec<u8>> {
    // The output is at most 21/4 of the input plus a few bytes, so below 512 MiB of input
    // offsets into it fit in 32 bits.
    if input.len() <= (u32::MAX / 8) as usize {
        canonicalize_with::<u32>(input)
    } else {
        canonicalize_with::<usize>(input)
    }
}

fn canonicalize_with<O: Offset>(input: &[u8]) -> Option<Vec<u8>> {
    let mut w = Writer::<'_, O>::new(input, Buffers::default());
    w.run()?;
    Some(w.buffers.out)
}

/// Calls `f` with the canonical form of `input`, or returns `None` when it is not a JSON
/// text, as [`canonicalize`] does; the canonical text and the working buffers are this
/// thread's, reused from one call to the next, so a fingerprint of a small body allocates
/// nothing once the thread has made one.
///
/// What a thread keeps between calls is bounded: a buffer that grew past [`KEEP_BYTES`]
/// (bytes, or entries of 4 bytes for the member offsets; the output's 16 bytes more, the room
/// it is given past its input's length) is freed, never kept.
pub(crate) fn with_canonical<R>(input: &[u8], f: impl FnOnce(&[u8]) -> R) -> Option<R> {
    if input.len() > (u32::MAX / 8) as usize {
        return canonicalize(input).map(|out| f(&out));
    }
    // Taken, not borrowed: a call made while this thread's buffers are out (there is none
    // today, `f` is the hash) gets fresh ones instead of a panic.
    let spare = SPARE.try_with(Cell::take).ok().flatten();
    let mut w = Writer::<'_, u32>::new(input, spare.unwrap_or_default());
    let canonical = w.run();
    let result = canonical.map(|()| f(&w.buffers.out));
    let mut buffers = w.buffers;
    if buffers.keep() {
        // Fails only while the thread is exiting: the buffers are then dropped here.
        let _ = SPARE.try_with(|spare| spare.set(Some(buffers)));
    }
    result
}

/// A buffer of more than this many bytes (or entries) is not kept for the thread's next
/// canonicalisation ([`with_canonical`]).
const KEEP_BYTES: usize = 16 * 1024;

thread_local! {
    /// This thread's buffers between two [`with_canonical`] calls.
    static SPARE: Cell<Option<Buffers<u32>>> = const { Cell::new(None) };
}

/// A [`Writer`]'s buffers, kept from one canonicalisation to the next by
/// [`with_canonical`].
struct Buffers<O> {
    out: Vec<u8>,
    /// Members of every object still open, innermost last: where each starts in `out` (the
    /// opening quote of its name). Its name and its end are found again in the written text
    /// when they are needed, so a member costs one offset.
    members: Vec<O>,
    /// Copy of an object's members while they are rewritten in order.
    scratch: Vec<u8>,
    /// The sort keys ([`name_key`]) of the members of an object of at most
    /// [`SMALL_OBJECT`] members while it is put in order (at most 1 KiB, whatever the input).
    keys: Vec<u128>,
}

impl<O> Default for Buffers<O> {
    fn default() -> Self {
        Buffers {
            out: Vec::new(),
            members: Vec::new(),
            scratch: Vec::new(),
            keys: Vec::new(),
        }
    }
}

impl<O> Buffers<O> {
    /// Empties the buffers for the next use, freeing any that grew past [`KEEP_BYTES`];
    /// whether any is left worth keeping.
    fn keep(&mut self) -> bool {
        fn bounded<T>(v: &mut Vec<T>, most: usize) {
            if v.capacity() > most {
                *v = Vec::new();
            } else {
                v.clear();
            }
        }
        // With the 16 bytes of room `Writer::new` reserves past an input's length.
        bounded(&mut self.out, KEEP_BYTES + 16);
        bounded(&mut self.scratch, KEEP_BYTES);
        bounded(&mut self.members, KEEP_BYTES / 4);
        // At most SMALL_OBJECT entries, whatever the input (`order_small`).
        self.keys.clear();
        self.out.capacity() + self.scratch.capacity() + self.members.capacity() > 0
    }
}

struct Writer<'a, O> {
    input: &'a [u8],
    pos: usize,
    buffers: Buffers<O>,
}

/// Objects of at most this many members are put in order through sort keys
/// ([`name_key`]) that carry a prefix of each name and the member's index, so that each
/// member's end is known from where the next began (no rescanning of the written text), and
/// most comparisons are one integer comparison. (At 16 bytes a member, 1 KiB at most.)
const SMALL_OBJECT: usize = 64;

impl<'a, O: Offset> Writer<'a, O> {
    /// A writer of `input`'s canonical form into `buffers` (emptied).
    fn new(input: &'a [u8], mut buffers: Buffers<O>) -> Self {
        // Kept buffers are emptied when kept; emptied again, so that no text of an earlier
        // input can reach this one's output whatever path they came back by.
        buffers.out.clear();
        buffers.members.clear();
        buffers.scratch.clear();
        buffers.keys.clear();
        // Room for the 16 bytes `order_small` puts past the text for a moment: on an output
        // no longer than its input (no number written out longer) they never reallocate it.
        buffers.out.reserve(input.len() + 16);
        Writer {
            input,
            pos: 0,
            buffers,
        }
    }

    /// Writes the canonical form of the whole input into `buffers.out`; `None` when the
    /// input is not a JSON text.
    fn run(&mut self) -> Option<()> {
        self.ws();
        self.value(0)?;
        self.ws();
        (self.pos == self.input.len()).then_some(())
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.pos += 1)
    }

    fn literal(&mut self, text: &[u8]) -> Option<()> {
        let end = self.pos.checked_add(text.len())?;
        (self.input.get(self.pos..end)? == text).then(|| {
            self.buffers.out.extend_from_slice(text);
            self.pos = end;
        })
    }

    /// One value at nesting `depth` (the number of arrays and objects around it).
    fn value(&mut self, depth: usize) -> Option<()> {
        match self.peek()? {
            b'{' => self.object(depth),
            b'[' => self.array(depth),
            b'"' => self.string(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        self.buffers.out.push(b'[');
        self.ws();
        if self.eat(b']').is_none() {
            loop {
                self.ws();
                self.value(depth + 1)?;
                self.ws();
                match self.peek()? {
                    b',' => {
                        self.pos += 1;
                        self.buffers.out.push(b',');
                    }
                    b']' => {
                        self.pos += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        self.buffers.out.push(b']');
        Some(())
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        self.buffers.out.push(b'{');
        self.ws();
        if self.eat(b'}').is_some() {
            self.buffers.out.push(b'}');
            return Some(());
        }
        let base = self.buffers.members.len();
        loop {
            self.ws();
            if self.peek()? != b'"' {
                return None;
            }
            if self.buffers.members.len() > base {
                self.buffers.out.push(b',');
            }
            let start = self.buffers.out.len();
            self.string()?;
            self.ws();
            self.eat(b':')?;
            self.buffers.out.push(b':');
            self.ws();
            self.value(depth + 1)?;
            self.buffers.members.push(O::at(start));
            self.ws();
            match self.peek()? {
                b',' => self.pos += 1,
                b'}' => {
                    self.pos += 1;
                    break;
                }
                _ => return None,
            }
        }
        self.order_members(base);
        self.buffers.members.truncate(base);
        self.buffers.out.push(b'}');
        Some(())
    }

    /// Rewrites the members from `base` on in canonical order, keeping only the last of
    /// members with equal names; nothing to do when they already are strictly ascending.
    fn order_members(&mut self, base: usize) {
        let out = &self.buffers.out;
        // Compared lazily, byte by byte: a comparison costs the common prefix, never the
        // names' whole length (a long name must not make every comparison with it expensive).
        if self.buffers.members[base..]
            .windows(2)
            .all(|pair| cmp_names(out, pair[0].get(), pair[1].get()) == Ordering::Less)
        {
            return;
        }
        if self.buffers.members.len() - base <= SMALL_OBJECT {
            self.order_small(base);
        } else {
            self.order_large(base);
        }
    }

    /// [`Self::order_members`], out of order, for an object of at most [`SMALL_OBJECT`]
    /// members: each member's end is the next one's start (less its comma), known before
    /// they move, and the members are sorted as integer keys ([`name_key`]) that carry their
    /// index; only keys that tie (names that share their first 12 bytes and go on past them)
    /// compare the names themselves. An object with a name whose key does not order it (an
    /// escape or a byte from 0xEE up in its first 16 bytes) is sorted on its names alone.
    fn order_small(&mut self, base: usize) {
        let len = self.buffers.out.len();
        // Sixteen bytes past the text while the keys are taken, so that each name's first
        // sixteen bytes can be read at once, the last member's included ([`name_prefix`]).
        self.buffers.out.extend_from_slice(&[0; 16]);
        let out = &self.buffers.out;
        let members = &self.buffers.members[base..];
        let keys = &mut self.buffers.keys;
        // Exact, so that it never holds more than SMALL_OBJECT.
        keys.clear();
        keys.reserve_exact(members.len());
        let mut keyed = true;
        for (i, m) in members.iter().enumerate() {
            let key = name_key(out, m.get());
            keyed &= key.is_some();
            keys.push(key.unwrap_or(0) | i as u128);
        }
        let start = |key: &u128| members[(key & KEY_INDEX) as usize].get();
        // Ties broken by index, which is input order: the order of a stable sort, so the
        // last of each run of equal names is the one that wins.
        let by_name = |a: &u128, b: &u128| {
            cmp_names(out, start(a), start(b)).then_with(|| (a & KEY_INDEX).cmp(&(b & KEY_INDEX)))
        };
        if keyed {
            keys.sort_unstable();
            let mut rest = &mut keys[..];
            while let Some((&first, _)) = rest.split_first() {
                let run = 1 + rest[1..]
                    .iter()
                    .take_while(|k| key_ties(first, **k))
                    .count();
                let (tied, after) = rest.split_at_mut(run);
                if run > 1 {
                    tied.sort_unstable_by(by_name);
                }
                rest = after;
            }
        } else {
            for key in keys.iter_mut() {
                *key &= KEY_INDEX;
            }
            keys.sort_unstable_by(by_name);
        }
        let region = members[0].get();
        self.buffers.out.truncate(len);
        self.take_region(region);
        let (scratch, keys) = (&self.buffers.scratch, &self.buffers.keys);
        let members = &self.buffers.members[base..];
        // Where the member of a key starts and ends in `scratch`: its end is the next one's
        // start, less its comma.
        let start = |key: &u128| members[(key & KEY_INDEX) as usize].get() - region;
        let end = |key: &u128| {
            members
                .get((key & KEY_INDEX) as usize + 1)
                .map_or(len, |next| next.get() - 1)
                - region
        };
        let name = |key: &u128| {
            let at = start(key);
            &scratch[at..string_end(scratch, at)]
        };
        let mut first = true;
        for (i, key) in keys.iter().enumerate() {
            // Canonical text is unique per name, so equal texts are equal names (and
            // equal names have keys that agree but for their index).
            let superseded = keys
                .get(i + 1)
                .is_some_and(|next| (!keyed || key >> 24 == next >> 24) && name(key) == name(next));
            if superseded {
                continue;
            }
            if !first {
                self.buffers.out.push(b',');
            }
            first = false;
            self.buffers
                .out
                .extend_from_slice(&scratch[start(key)..end(key)]);
        }
    }

    /// [`Self::order_members`], out of order, for a larger object: one offset per member, sorted in place,
    /// each member's end found again in the text.
    fn order_large(&mut self, base: usize) {
        let out = &self.buffers.out;
        let cmp = |a: &O, b: &O| cmp_names(out, a.get(), b.get());
        let members = &mut self.buffers.members[base..];
        let region = members[0].get();
        // In place; ties broken by position, which is input order: the order of a stable
        // sort, so the last of each run of equal names is the one that wins.
        members.sort_unstable_by(|a, b| cmp(a, b).then_with(|| a.cmp(b)));
        self.take_region(region);
        let (scratch, members) = (&self.buffers.scratch, &self.buffers.members[base..]);
        let name = |m: &O| {
            let at = m.get() - region;
            &scratch[at..string_end(scratch, at)]
        };
        let mut first = true;
        for (i, m) in members.iter().enumerate() {
            // Canonical text is unique per name, so equal texts are equal names.
            let superseded = members.get(i + 1).is_some_and(|next| name(m) == name(next));
            if superseded {
                continue;
            }
            if !first {
                self.buffers.out.push(b',');
            }
            first = false;
            let at = m.get() - region;
            self.buffers
                .out
                .extend_from_slice(&scratch[at..member_end(scratch, at)]);
        }
    }

    /// Moves the written text from `region` on into `scratch`, to be written again in order.
    fn take_region(&mut self, region: usize) {
        let len = self.buffers.out.len() - region;
        if self.buffers.scratch.capacity() < len {
            // Freed before the larger one is taken: never both at once.
            self.buffers.scratch = Vec::new();
            self.buffers.scratch.reserve_exact(len);
        }
        self.buffers.scratch.clear();
        self.buffers
            .scratch
            .extend_from_slice(&self.buffers.out[region..]);
        self.buffers.out.truncate(region);
    }

    /// A string, written canonically. Runs of plain ASCII are copied as they are; other
    /// UTF-8 is validated a character at a time (outside strings the grammar admits no byte
    /// above 0x7F).
    fn string(&mut self) -> Option<()> {
        self.pos += 1;
        self.buffers.out.push(b'"');
        loop {
            let rest = &self.input[self.pos..];
            let run = plain_run(rest)?;
            self.buffers.out.extend_from_slice(&rest[..run]);
            self.pos += run;
            match self.input[self.pos] {
                b'"' => {
                    self.pos += 1;
                    self.buffers.out.push(b'"');
                    return Some(());
                }
                b'\\' => {
                    let c = self.escape()?;
                    write_char(&mut self.buffers.out, c);
                }
                lead @ 0x80.. => {
                    let len = utf8_len(lead)?;
                    let bytes = self.input.get(self.pos..self.pos + len)?;
                    std::str::from_utf8(bytes).ok()?;
                    self.buffers.out.extend_from_slice(bytes);
                    self.pos += len;
                }
                _ => return None,
            }
        }
    }

    /// The character an escape sequence stands for (`pos` at the backslash).
    fn escape(&mut self) -> Option<char> {
        let kind = *self.input.get(self.pos + 1)?;
        self.pos += 2;
        Some(match kind {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let high = self.hex4()?;
                match high {
                    0xD800..=0xDBFF => {
                        if self.input.get(self.pos..self.pos + 2)? != b"\\u" {
                            return None;
                        }
                        self.pos += 2;
                        let low = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return None;
                        }
                        let c = 0x10000
                            + ((u32::from(high) - 0xD800) << 10)
                            + (u32::from(low) - 0xDC00);
                        char::from_u32(c)?
                    }
                    0xDC00..=0xDFFF => return None,
                    _ => char::from_u32(u32::from(high))?,
                }
            }
            _ => return None,
        })
    }

    fn hex4(&mut self) -> Option<u16> {
        let digits = self.input.get(self.pos..self.pos + 4)?;
        let mut n = 0u16;
        for &d in digits {
            n = n << 4 | u16::from((d as char).to_digit(16)? as u8);
        }
        self.pos += 4;
        Some(n)
    }

    /// A number, validated against the JSON grammar and written as JCS writes its double.
    fn number(&mut self) -> Option<()> {
        let start = self.pos;
        self.eat(b'-');
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        let int_end = self.pos;
        let mut integer = true;
        if self.eat(b'.').is_some() {
            integer = false;
            self.some_digits()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            integer = false;
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            self.some_digits()?;
        }
        let text = &self.input[start..self.pos];
        let negative = text[0] == b'-';
        // Integers of up to 15 digits are exact doubles, written the same way: skip the
        // conversion (the common case: amounts, counts, ids).
        if integer && int_end - start - usize::from(negative) <= 15 {
            if text == b"-0" {
                self.buffers.out.push(b'0');
            } else {
                self.buffers.out.extend_from_slice(text);
            }
            return Some(());
        }
        // The grammar was checked above; Rust's parser rounds correctly, as `serde_json`
        // (with `float_roundtrip`, which `serde_jcs` enables) does.
        let value: f64 = std::str::from_utf8(text).ok()?.parse().ok()?;
        if !value.is_finite() {
            return None;
        }
        let mut buffer = ryu_js::Buffer::new();
        self.buffers
            .out
            .extend_from_slice(buffer.format_finite(value).as_bytes());
        Some(())
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    fn some_digits(&mut self) -> Option<()> {
        let start = self.pos;
        self.digits();
        (self.pos > start).then_some(())
    }
}

/// Bytes that end a run of plain string content: `"`, `\\`, controls, and non-ASCII.
static STOP: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = b < 0x20 || b == b'"' as usize || b == b'\\' as usize || b >= 0x80;
        b += 1;
    }
    table
};

/// How many bytes of plain string content `rest` starts with (up to the first byte of
/// [`STOP`]; `None` if there is none). Eight bytes at a time while they are plain.
fn plain_run(rest: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::MAX / 0xFF;
    const HIGH: u64 = ONES << 7;
    let mut at = 0;
    while let Some(chunk) = rest.get(at..at + 8) {
        let x = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
        // The high bit of each byte that is below 0x20, a quote, a backslash or above 0x7F
        // (a byte after one of these may be marked too, never one before it).
        let below = x.wrapping_sub(ONES * 0x20);
        let quote = x ^ (ONES * u64::from(b'"'));
        let backslash = x ^ (ONES * u64::from(b'\\'));
        let stops = ((below
            | quote.wrapping_sub(ONES) & !quote
            | backslash.wrapping_sub(ONES) & !backslash)
            & !x
            & HIGH)
            | (x & HIGH);
        if stops != 0 {
            return Some(at + (stops.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    rest[at..]
        .iter()
        .position(|&b| STOP[usize::from(b)])
        .map(|run| at + run)
}

/// The length of the UTF-8 sequence a lead byte starts (`None` for a continuation byte or a
/// byte that never appears in UTF-8).
fn utf8_len(lead: u8) -> Option<usize> {
    match lead {
        0xC2..=0xDF => Some(2),
        0xE0..=0xEF => Some(3),
        0xF0..=0xF4 => Some(4),
        _ => None,
    }
}

/// Writes `c` as JCS does (the `serde_json` escapes: the short forms, `\u00XX` in lower-case
/// hex for other controls, `\"` and `\\`; everything else as UTF-8).
fn write_char(out: &mut Vec<u8>, c: char) {
    let short = match c {
        '"' => b'"',
        '\\' => b'\\',
        '\u{8}' => b'b',
        '\u{c}' => b'f',
        '\n' => b'n',
        '\r' => b'r',
        '\t' => b't',
        c if (c as u32) < 0x20 => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            let b = c as u8;
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ]);
            return;
        }
        c => {
            let mut buf = [0; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            return;
        }
    };
    out.extend_from_slice(&[b'\\', short]);
}

/// In canonical text, the index just past the string whose opening quote is at `at` (the
/// text's end if it is cut short).
fn string_end(text: &[u8], at: usize) -> usize {
    let mut i = at + 1;
    while let Some(run) = text[i.min(text.len())..]
        .iter()
        .position(|b| *b == b'"' || *b == b'\\')
    {
        i += run;
        if text[i] == b'"' {
            return i + 1;
        }
        i += 2;
    }
    text.len()
}

/// In the canonical text of an object's members (`"a":1,"b":[2,3]`), the end of the member
/// starting at `at`: the next comma outside its value, or the text's end.
fn member_end(text: &[u8], at: usize) -> usize {
    let mut depth = 0usize;
    let mut i = at;
    while let Some(&b) = text.get(i) {
        match b {
            b'"' => {
                i = string_end(text, i);
                continue;
            }
            b'[' | b'{' => depth += 1,
            b']' | b'}' => depth = depth.saturating_sub(1),
            b',' if depth == 0 => return i,
            _ => {}
        }
        i += 1;
    }
    text.len()
}

/// The first 16 bytes of the name whose opening quote is at `at`, as a big-endian integer
/// padded with zeros past the closing quote (no name holds a zero byte: controls are
/// escaped), so that two prefixes that differ order as their names do; `None` when the
/// bytes hold an escape or a byte from 0xEE up (see [`first_difference`]).
#[inline]
fn name_prefix(text: &[u8], at: usize) -> Option<u128> {
    const ONES: u128 = u128::MAX / 0xFF;
    const HIGH: u128 = ONES << 7;
    /// Bytes of `x` that are zero, as their high bits (a byte after a zero byte may be
    /// marked too, never one before it).
    fn zeros(x: u128) -> u128 {
        x.wrapping_sub(ONES) & !x & HIGH
    }
    let start = at + 1;
    if let Some(chunk) = text.get(start..start + 16) {
        // Sixteen bytes at once, the first in the lowest byte: the first quote, backslash or
        // byte above 0x7F found in a few operations. The name is exact if that is its
        // closing quote, or if there is none in these 16 bytes.
        let x = u128::from_le_bytes(chunk.try_into().unwrap_or_default());
        let stops = zeros(x ^ (ONES * u128::from(b'"')))
            | zeros(x ^ (ONES * u128::from(b'\\')))
            | (x & HIGH);
        let len = (stops.trailing_zeros() / 8) as usize;
        if len >= 16 {
            return Some(x.swap_bytes());
        }
        if chunk[len] == b'"' {
            return Some((x & ((1u128 << (8 * len)) - 1)).swap_bytes());
        }
    }
    name_prefix_slow(text, start)
}

/// [`name_prefix`] of the name that starts at `start`, where its 16 bytes are not all in the
/// text or hold a byte above 0x7F or an escape before the name's end: a byte at a time.
#[inline(never)]
fn name_prefix_slow(text: &[u8], start: usize) -> Option<u128> {
    let window = &text[start..text.len().min(start + 16)];
    let name = &window[..window
        .iter()
        .position(|&b| b == b'"')
        .unwrap_or(window.len())];
    if name.iter().any(|&b| b == b'\\' || b >= 0xEE) {
        return None;
    }
    let mut prefix = [0u8; 16];
    prefix[..name.len()].copy_from_slice(name);
    Some(u128::from_be_bytes(prefix))
}

/// The bits of a [`name_key`] that hold the member's index.
const KEY_INDEX: u128 = (1 << 24) - 1;

/// The sort key of the name whose opening quote is at `at`, for a member whose index goes
/// in its low 24 bits: the name's first 12 bytes (big-endian, zero past its end), then how
/// many there are (13 when the name goes on past them), so that keys order names as
/// [`cmp_names`] does, but for two names that share their first 12 bytes and both go on
/// ([`key_ties`]). `None` where [`name_prefix`] is.
///
/// Zero padding is exact: no name holds a zero byte (controls are escaped), so where one
/// name has ended the other goes on with a larger byte, and the counts agree with that.
#[inline]
fn name_key(text: &[u8], at: usize) -> Option<u128> {
    let prefix = name_prefix(text, at)?;
    // The name's length within the 16 bytes: the bytes before the zero padding.
    let len = 16 - u128::from(prefix.trailing_zeros() / 8);
    Some(prefix >> 32 << 32 | len.min(13) << 24)
}

/// Whether two [`name_key`]s do not order their names: the same 12 bytes, and both go on.
fn key_ties(a: u128, b: u128) -> bool {
    a >> 24 == b >> 24 && (a >> 24) & 0xff == 13
}

/// Orders the names whose opening quotes are at `a` and `b` in canonical text by their
/// UTF-16 code units (see [`first_difference`]), decoding only from the first byte where
/// their spellings differ or one of them holds an escape.
fn cmp_names(text: &[u8], a: usize, b: usize) -> Ordering {
    let (x, y) = (&text[a + 1..], &text[b + 1..]);
    let same = x
        .iter()
        .zip(y)
        .position(|(p, q)| p != q || *p == b'"' || *p == b'\\')
        .unwrap_or(x.len().min(y.len()));
    match (x.get(same), y.get(same)) {
        // Both end here.
        (Some(b'"'), Some(b'"')) => Ordering::Equal,
        // One ends, the other goes on with a character of its own (a quote in a name is
        // escaped, so a quote is its end): the shorter is first.
        (Some(b'"'), Some(&q)) if q != b'\\' => Ordering::Less,
        (Some(&p), Some(b'"')) if p != b'\\' => Ordering::Greater,
        // Plain bytes that differ.
        (Some(&p), Some(&q)) if p != b'\\' && q != b'\\' => first_difference(p, q),
        // An escape on either side: decode from here.
        _ => cmp_utf16_bytes(Decoded::new(&x[same..]), Decoded::new(&y[same..])),
    }
}

/// The bytes of a name as [`write_char`] wrote it, decoded one at a time, up to its closing
/// quote.
struct Decoded<'a> {
    text: &'a [u8],
}

impl<'a> Decoded<'a> {
    fn new(text: &'a [u8]) -> Self {
        Decoded { text }
    }
}

impl Iterator for Decoded<'_> {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        let (&first, rest) = self.text.split_first()?;
        if first == b'"' {
            return None;
        }
        if first != b'\\' {
            self.text = rest;
            return Some(first);
        }
        let (&kind, rest) = rest.split_first()?;
        if kind == b'u' {
            // `\u00XX`: only controls are written this way.
            let value = rest
                .get(2..4)
                .and_then(|hex| std::str::from_utf8(hex).ok())
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())?;
            self.text = rest.get(4..).unwrap_or_default();
            return Some(value);
        }
        self.text = rest;
        Some(match kind {
            b'b' => 0x8,
            b'f' => 0xc,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            other => other,
        })
    }
}

/// Orders two streams of UTF-8 bytes by their UTF-16 code units (RFC 8785 §3.2.3). Byte
/// order is code point order, which differs from UTF-16 order only where a character at or
/// above U+10000 (4 UTF-8 bytes, lead 0xF0–0xF4; a surrogate pair in UTF-16, 0xD800–0xDBFF
/// first) meets one in U+E000–U+FFFF (lead 0xEE or 0xEF): the pair sorts first. Where the
/// first differing bytes are continuation bytes, the characters share a lead byte and so a
/// length.
fn cmp_utf16_bytes(mut a: impl Iterator<Item = u8>, mut b: impl Iterator<Item = u8>) -> Ordering {
    loop {
        match (a.next(), b.next()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x == y => {}
            (Some(x), Some(y)) => return first_difference(x, y),
        }
    }
}

/// The order of two UTF-8 texts whose first differing bytes are `x` and `y` (see
/// [`cmp_utf16_bytes`]).
fn first_difference(x: u8, y: u8) -> Ordering {
    if x >= 0xEE && y >= 0xEE && (x >= 0xF0) != (y >= 0xF0) {
        y.cmp(&x)
    } else {
        x.cmp(&y)
    }
}

#[cfg(test)]
mod tests {
    //! Differential tests: `serde_json` + `serde_jcs` (the previous implementation) is the
    //! oracle, for valid and invalid texts alike. `PROPTEST_CASES` raises the case count.
    use super::*;
    use proptest::prelude::*;

    fn oracle(body: &[u8]) -> Option<Vec<u8>> {
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        serde_jcs::to_vec(&value).ok()
    }

    #[track_caller]
    fn agrees(text: &[u8]) {
        let ours = canonicalize(text);
        let theirs = oracle(text);
        assert_eq!(
            ours.as_deref().map(String::from_utf8_lossy),
            theirs.as_deref().map(String::from_utf8_lossy),
            "input {:?}",
            String::from_utf8_lossy(text)
        );
    }

    /// The RFC 8785 test data (cyberphone/json-canonicalization `testdata/input` →
    /// `output`), plus the sorting example of §3.2.3.
    #[test]
    fn rfc8785_vectors() {
        let cases: &[(&str, &str)] = &[
            (
                r#"[56, {"d": true, "10": null, "1": [ ]}]"#,
                r#"[56,{"1":[],"10":null,"d":true}]"#,
            ),
            (
                r#"{"peach": "This sorting order", "péché": "is wrong according to French", "pêche": "but canonicalization MUST", "sin": "ignore locale"}"#,
                r#"{"peach":"This sorting order","péché":"is wrong according to French","pêche":"but canonicalization MUST","sin":"ignore locale"}"#,
            ),
            (
                r#"{"1": {"f": {"f": "hi","F": 5} ,"\n": 56.0}, "10": { }, "": "empty", "a": { }, "111": [ {"e": "yes","E": "no" } ], "A": { }}"#,
                r#"{"":"empty","1":{"\n":56,"f":{"F":5,"f":"hi"}},"10":{},"111":[{"E":"no","e":"yes"}],"A":{},"a":{}}"#,
            ),
            (
                r#"{"Unnormalized Unicode":"A\u030a"}"#,
                "{\"Unnormalized Unicode\":\"A\u{30a}\"}",
            ),
            (
                r#"{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}"#,
                r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#,
            ),
            (
                r#"{"\u20ac": "Euro Sign", "\r": "Carriage Return", "\u000a": "Newline", "1": "One", "\u0080": "Control\u007f", "\ud83d\ude02": "Smiley", "\u00f6": "Latin Small Letter O With Diaeresis", "\ufb33": "Hebrew Letter Dalet With Dagesh", "</script>": "Browser Challenge"}"#,
                "{\"\\n\":\"Newline\",\"\\r\":\"Carriage Return\",\"1\":\"One\",\"</script>\":\"Browser Challenge\",\"\u{80}\":\"Control\u{7f}\",\"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\"😂\":\"Smiley\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}",
            ),
        ];
        for (input, want) in cases {
            let got = canonicalize(input.as_bytes()).map(|v| String::from_utf8(v).expect("UTF-8"));
            assert_eq!(got.as_deref(), Some(*want), "{input}");
            agrees(input.as_bytes());
        }
    }

    /// RFC 8785 Appendix B: every double of the table, written in JCS form.
    #[test]
    fn rfc8785_appendix_b_numbers() {
        for (bits, want) in [
            (0x0000000000000000u64, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ] {
            let value = f64::from_bits(bits);
            // Rust's shortest round-trip text in both notations, and the expected text itself.
            for text in [format!("{value:e}"), format!("{value:?}"), want.to_string()] {
                let got = canonicalize(format!("[{text}]").as_bytes());
                assert_eq!(got, Some(format!("[{want}]").into_bytes()), "{text}");
                agrees(format!("[{text}]").as_bytes());
            }
        }
    }

    #[test]
    fn edge_cases_agree_with_the_oracle() {
        let mut cases: Vec<Vec<u8>> = [
            "",
            " ",
            "0",
            "-0",
            "-0.0",
            "01",
            "1.",
            ".1",
            "-",
            "1e",
            "1e+",
            "1E-0",
            "+1",
            "1e400",
            "-1e400",
            "1e-400",
            "123456789012345",
            "1234567890123456",
            "9007199254740993",
            "-9007199254740993",
            "18446744073709551615",
            "18446744073709551616",
            "-9223372036854775809",
            "100000000000000000000000",
            "0.1e1",
            "1.5e308",
            "[1,]",
            "[,1]",
            "{\"a\":1,}",
            "{\"a\" 1}",
            "{1:2}",
            "{\"a\"}",
            "\"\\ud800\"",
            "\"\\udc00\"",
            "\"\\ud800\\u0041\"",
            "\"\\ud800x\"",
            "\"\\ud83d\\ude00\"",
            "\"\\uD83D\\uDE00\"",
            "\"\\u00zz\"",
            "\"\\x\"",
            "\"\\u12\"",
            "\"a\tb\"",
            "\"\u{7f}\"",
            "\"\\u007f\\u001f\\u0000\"",
            "\"\\u2028\\u2029\"",
            "\"é\"",
            "tru",
            "true ",
            " true",
            "truex",
            "nul",
            "[true false]",
            "{}",
            "[]",
            "[[]]",
            "{\"\":{}}",
            "\u{feff}{}",
            "{} {}",
            "\"\\/\"",
            "[1]\u{0}",
            "[\r\n\t1 ]",
            "{\"a\":1,\"a\":2}",
            "{\"b\":1,\"a\":2,\"b\":3}",
            "{\"a\":1,\"\\u0061\":2}",
            "{\"a\\n\":1,\"a\\u000a\":2,\"a\":3}",
            "{\"\\u0000\":1,\"\":2}",
            "{\"\u{e000}\":1,\"\u{10000}\":2,\"\u{ffff}\":3}",
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
        cases.push(b"\"\xff\"".to_vec());
        cases.push(b"[\"\xc3\"]".to_vec());
        cases.push(b"\xef\xbb\xbf{}".to_vec());
        for depth in [1, 126, 127, 128, 129, 5000] {
            cases.push(format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes());
            cases.push(format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth)).into_bytes());
            cases.push("[".repeat(depth).into_bytes());
        }
        // Many short names in order and one long escaped name that sorts first: the merge
        // compares the long name with every other one (cheap only if comparing costs the
        // common prefix, not the name's length).
        let mut hostile: String = (0..10_000).map(|i| format!("\"a{i:06}\":0,")).collect();
        hostile.insert(0, '{');
        hostile.push_str(&format!("\"{}\":1}}", "\\n".repeat(100_000)));
        cases.push(hostile.into_bytes());
        for case in &cases {
            agrees(case);
        }
        // Deep nesting is refused without recursing past the limit.
        assert_eq!(canonicalize("[".repeat(1 << 20).as_bytes()), None);
    }

    /// Strings with every kind of escape, and names chosen to collide and to sort differently
    /// in UTF-8 and UTF-16.
    fn json_string() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            4 => "[a-zA-Z0-9 ]{0,6}",
            1 => Just("é".to_string()),
            1 => Just("\u{e000}".to_string()),
            1 => Just("\u{ffff}".to_string()),
            1 => Just("😀".to_string()),
            1 => Just("\u{10ffff}".to_string()),
            1 => Just("\u{7f}".to_string()),
            1 => prop::sample::select(vec!["\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t"])
                .prop_map(str::to_string),
            2 => prop_oneof![0u16..0xD800, 0xE000u16..=0xFFFF].prop_map(|u| format!("\\u{u:04x}")),
            1 => (0xD800u16..0xDC00, 0xDC00u16..0xE000)
                .prop_map(|(h, l)| format!("\\u{h:04X}\\u{l:04x}")),
            1 => (0u8..0x20).prop_map(|c| format!("\\u{c:04x}")),
        ];
        prop::collection::vec(piece, 0..4).prop_map(|p| format!("\"{}\"", p.concat()))
    }

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => prop::sample::select(vec![
                "\"a\"", "\"\\u0061\"", "\"b\"", "\"A\"", "\"\"", "\"aa\"", "\"é\"", "\"\\u00e9\"",
                "\"\u{e000}\"", "\"😀\"", "\"\\ud83d\\ude00\"", "\"\\n\"", "\"\\u000a\"", "\"\\u0000\"",
            ])
            .prop_map(str::to_string),
            1 => json_string(),
        ]
    }

    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            any::<u64>().prop_map(|n| n.to_string()),
            (-1000i32..1000).prop_map(|n| n.to_string()),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| format!("{f:?}")),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| format!("{f:e}")),
            (
                "-?[1-9][0-9]{0,30}",
                "(\\.[0-9]{1,25})?",
                "([eE][+-]?[0-9]{1,2})?"
            )
                .prop_map(|(i, f, e)| format!("{i}{f}{e}")),
            "-?[1-9](\\.[0-9]{1,25})?[eE]([+]?30[0-7]|-3[0-2][0-9])",
            Just("-0".to_string()),
            Just("0.0".to_string()),
        ]
    }

    fn ws() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["", "", "", " ", "\n", "\t ", "\r\n"])
    }

    fn json() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_string()),
            Just("true".to_string()),
            Just("false".to_string()),
            number(),
            json_string(),
        ];
        leaf.prop_recursive(6, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec((ws(), inner.clone(), ws()), 0..6).prop_map(|items| {
                    let items: Vec<String> = items
                        .into_iter()
                        .map(|(a, v, b)| format!("{a}{v}{b}"))
                        .collect();
                    format!("[{}]", items.join(","))
                }),
                prop::collection::vec((ws(), name(), ws(), inner, ws()), 0..6).prop_map(
                    |members| {
                        let members: Vec<String> = members
                            .into_iter()
                            .map(|(a, k, b, v, c)| format!("{a}{k}{b}:{v}{c}"))
                            .collect();
                        format!("{{{}}}", members.join(","))
                    }
                ),
            ]
        })
    }

    /// `with_canonical` through this thread's kept buffers.
    fn reused(text: &[u8]) -> Option<Vec<u8>> {
        with_canonical(text, <[u8]>::to_vec)
    }

    #[test]
    fn kept_buffers_are_reused_and_write_what_fresh_ones_do() {
        // Each text after a longer one, an unsorted one, an invalid one (stopped midway, its
        // members and scratch part-filled) and an empty one: the output is the fresh writer's.
        let texts: [&[u8]; 7] = [
            br#"{"z":{"y":[1,2,{"b":1,"a":2}],"x":"long text long text long text"},"a":0}"#,
            br#"{"b":1,"a":2}"#,
            br#"{"b":{"d":1,"c":2},"a":[1,2,"#,
            b"1",
            br#"{"d":4,"c":3,"b":2,"a":1}"#,
            b"",
            br#"{"a":"\u00e9"}"#,
        ];
        for _ in 0..2 {
            for text in texts {
                assert_eq!(
                    reused(text),
                    canonicalize(text),
                    "{}",
                    String::from_utf8_lossy(text)
                );
            }
        }
        // Reused: a call writes into the thread's spare output buffer (planted here with a
        // capacity no fresh one would have), and keeps it for the next call.
        SPARE.set(Some(Buffers {
            out: Vec::with_capacity(4096),
            ..Buffers::default()
        }));
        let planted = SPARE.with(|spare| {
            let buffers = spare.take().expect("planted");
            let at = buffers.out.as_ptr();
            spare.set(Some(buffers));
            at
        });
        for text in [&br#"{"b":1,"a":2}"#[..], br#"{"d":1,"c":2}"#] {
            let wrote = with_canonical(text, <[u8]>::as_ptr).unwrap();
            assert_eq!(wrote, planted);
            let kept = SPARE.take().expect("buffers kept");
            assert_eq!((kept.out.as_ptr(), kept.out.capacity()), (planted, 4096));
            SPARE.set(Some(kept));
        }
    }

    #[test]
    fn kept_buffers_stay_within_their_bound() {
        let capacities = || {
            let spare = SPARE.take().expect("buffers kept");
            let c = (
                spare.out.capacity(),
                spare.scratch.capacity(),
                spare.members.capacity(),
            );
            SPARE.set(Some(spare));
            c
        };
        // An object of 5,000 members, out of order: the text, its copy and the member offsets
        // grow past their bounds (`keys` is not used: the object is sorted in place).
        let big: String = format!(
            "{{{}}}",
            (0..5_000)
                .rev()
                .map(|i| format!(r#""k{i:05}":{i}"#))
                .collect::<Vec<_>>()
                .join(",")
        );
        assert_eq!(reused(big.as_bytes()), canonicalize(big.as_bytes()));
        assert!(
            SPARE.take().is_none(),
            "nothing worth keeping after a large text"
        );
        // A small text's buffers are kept.
        assert!(reused(br#"{"b":1,"a":2}"#).is_some());
        let small = capacities();
        assert!(small.0 > 0 && small.1 > 0 && small.2 > 0, "{small:?}");
        // The small-object sort holds at most SMALL_OBJECT members, kept or not.
        let widest = format!(
            "{{{}}}",
            (0..SMALL_OBJECT)
                .rev()
                .map(|i| format!(r#""k{i:02}":{i}"#))
                .collect::<Vec<_>>()
                .join(",")
        );
        assert_eq!(reused(widest.as_bytes()), canonicalize(widest.as_bytes()));
        let spare = SPARE.take().expect("buffers kept");
        assert!(spare.keys.capacity() >= 1 && spare.keys.capacity() <= SMALL_OBJECT);
        SPARE.set(Some(spare));
        // A long string out of order: the text and its copy grow past the bound and are freed,
        // the two member offsets are kept.
        let long = format!(r#"{{"b":"{}","a":1}}"#, "x".repeat(2 * KEEP_BYTES));
        assert_eq!(reused(long.as_bytes()), canonicalize(long.as_bytes()));
        let after = capacities();
        assert!(after.0 == 0 && after.1 == 0 && after.2 > 0, "{after:?}");
    }

    proptest! {
        /// Valid texts: the same canonical bytes as the oracle.
        #[test]
        fn generated_json_agrees(text in json(), pad in ws()) {
            let text = format!("{pad}{text}{pad}");
            prop_assert!(oracle(text.as_bytes()).is_some(), "generator made invalid JSON: {}", text);
            agrees(text.as_bytes());
            // Offsets of either width write the same text, and so do this thread's kept buffers.
            prop_assert_eq!(canonicalize_with::<usize>(text.as_bytes()), canonicalize(text.as_bytes()));
            prop_assert_eq!(reused(text.as_bytes()), canonicalize(text.as_bytes()));
        }

        /// Damaged texts (a byte changed, removed or inserted): both refuse, or both accept
        /// with the same canonical bytes.
        #[test]
        fn damaged_json_agrees(text in json(), at in any::<prop::sample::Index>(), byte in any::<u8>(), how in 0..3u8) {
            let mut bytes = text.into_bytes();
            let i = at.index(bytes.len() + 1);
            match how {
                0 if i < bytes.len() => bytes[i] = byte,
                1 if i < bytes.len() => { bytes.remove(i); }
                _ => bytes.insert(i, byte),
            }
            agrees(&bytes);
            prop_assert_eq!(reused(&bytes), canonicalize(&bytes));
        }

        /// Names that share a stem of up to 21 bytes: past the 12 bytes of a small object's
        /// sort keys, where they tie and the whole names decide, and past the 16 it reads
        /// at once; in objects of either size.
        #[test]
        fn long_shared_names_agree(
            members in prop::collection::vec(
                // With the three members named below: 3 to 18 members, SMALL_OBJECT and one
                // more (either side of the boundary), or more than 100.
                (0..22usize, name(), prop_oneof![
                    Just(0usize),
                    0..16usize,
                    SMALL_OBJECT - 3..=SMALL_OBJECT - 2,
                    100..300usize,
                ]),
                1..8,
            ),
        ) {
            for (shared, suffix, count) in members {
                let stem = &"abcdefghijklmnopqrstuv"[..shared];
                let suffix = &suffix[1..suffix.len() - 1];
                // `count` members around the one named: a small object, or one past
                // SMALL_OBJECT (sorted by the other path).
                let text = format!(
                    "{{{}\"{stem}{suffix}\":1,\"{stem}\":2,\"{stem}{suffix}\":3}}",
                    (0..count).rev().map(|i| format!("\"{stem}{i:03}\":{i},")).collect::<String>(),
                );
                agrees(text.as_bytes());
            }
        }

        /// Canonical output is a fixed point.
        #[test]
        fn canonical_form_is_stable(text in json()) {
            let once = canonicalize(text.as_bytes()).expect("valid");
            let twice = canonicalize(&once);
            prop_assert_eq!(twice.as_deref(), Some(&once[..]));
        }
    }
}
