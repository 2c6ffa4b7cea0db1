//! The fingerprint's working memory is bounded by a small multiple of the body: a hostile body
//! (a form of a million one-byte fields, JSON of many tiny members, deep nesting, long escaped
//! strings) must not cost tens of times its size. Measured with a counting global allocator,
//! which is why this is a test binary of its own: the allocator only counts here.
//!
//! The bound is on the *peak* of what a fingerprint allocates on top of what the thread held
//! before the call (the body itself is the caller's): at most [`BOUND`] times the body, plus
//! [`SLACK`] bytes for small bodies.
//!
//! `FUZZ_CASES` raises the number of generated bodies per test (default 24; each body is up to
//! 2 MiB).
#![allow(clippy::unwrap_used)]
// tests unwrap freely
// A `GlobalAlloc` must be an `unsafe impl`: this file is the one place the workspace allows
// unsafe code (the workspace lint is `deny`, not `forbid`, so that this allow is possible).
#![allow(unsafe_code)]

use idempotent_core::{fingerprint::Fingerprint, fingerprint::FingerprintInput};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Peak extra allocation allowed, as a multiple of the body's size.
const BOUND: usize = 4;
/// Plus a constant, for what every fingerprint costs whatever the body (a first small buffer,
/// the JSON writer's 1 KiB at most for sorting a small object, the media type's lower-case and
/// the method's upper-case copies when they were not in that case already).
const SLACK: usize = 4096;

/// The system allocator, counting what each thread holds and the most it held.
struct Counting;

thread_local! {
    /// Bytes allocated minus bytes freed on this thread (may go negative when a thread frees
    /// what another allocated; only differences within one call are used).
    static CURRENT: Cell<isize> = const { Cell::new(0) };
    /// The highest `CURRENT` since the last reset.
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn add(delta: isize) {
    // `try_with`: never panic inside the allocator (a thread being torn down).
    let _ = CURRENT.try_with(|current| {
        let now = current.get() + delta;
        current.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// `GlobalAlloc` contract holds as it does for `System`; the bookkeeping only touches
// const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            add(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            add(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is (see the impl).
        unsafe { System.dealloc(ptr, layout) };
        add(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is (see the impl).
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Counted as the new block allocated before the old one is freed, which is what a
            // moving realloc costs at its peak.
            add(new_size as isize);
            add(-(layout.size() as isize));
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The most `f` allocated at once on this thread, beyond what the thread held before.
fn peak_of<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let base = CURRENT.with(Cell::get);
    PEAK.with(|peak| peak.set(base));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (usize::try_from(peak - base).unwrap_or(0), out)
}

fn fingerprint(content_type: &str, body: &[u8]) -> Fingerprint {
    Fingerprint::compute(&FingerprintInput {
        method: "POST",
        path: "/v1/charges",
        query: None,
        content_type: Some(content_type),
        body,
    })
}

/// Asserts the bound for one body, naming its shape and the figure.
#[track_caller]
fn check(shape: &str, content_type: &str, body: &[u8]) {
    let (peak, _) = peak_of(|| fingerprint(content_type, body));
    let len = body.len().max(1);
    assert!(
        peak <= BOUND * len + SLACK,
        "{shape}: peak {peak} bytes ({:.1} MiB, {:.1}x) for a {len}-byte ({:.2} MiB) body, more than {BOUND}x + {SLACK}",
        peak as f64 / f64::from(1 << 20),
        peak as f64 / len as f64,
        len as f64 / f64::from(1 << 20),
    );
}

/// `unit` repeated to about `size` bytes.
fn repeat(unit: &str, size: usize) -> Vec<u8> {
    unit.repeat(size / unit.len().max(1)).into_bytes()
}

fn runner() -> TestRunner {
    let cases = std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(24);
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// Body sizes: small ones, and up to the default request limit (2 MiB).
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..4096, 4096usize..(2 << 20), Just(2 << 20)]
}

const FORM: &str = "application/x-www-form-urlencoded";
const JSON: &str = "application/json";

/// The form shapes that cost the most per byte: one- and two-byte fields (`&a&a…`, a record
/// per pair), many values of one field, fields out of order (sorted), escapes and `+` that
/// decode, bytes that encode to three. The unit repeated, and the size (the body is built in
/// the test, so a failure prints its recipe, not 2 MiB).
fn form_body() -> impl Strategy<Value = (String, usize)> {
    let shape = prop::sample::select(vec![
        "&a",
        "a&",
        "a=1&",
        "&&a",
        "a=%41&",
        "%61=b&",
        "a+b=c+d&",
        "~&",
        "%7e=%7E&",
        "=&",
        "b&a&",
        "z=1&y=2&x=3&",
        "%FF&",
    ]);
    let random = (prop::collection::vec(prop::sample::select(b"&=+%aAzZ09~ \xff".to_vec()), 1..64))
        .prop_map(|unit| String::from_utf8_lossy(&unit).into_owned());
    (prop_oneof![shape.prop_map(str::to_owned), random], size())
}

/// Distinct field names in descending order, so every pair moves.
fn descending_fields(size: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(size + 16);
    let mut i = u32::MAX;
    while body.len() < size {
        body.extend_from_slice(format!("{i:x}=&").as_bytes());
        i -= 1;
    }
    body
}

/// JSON shapes: many small members (in order, out of order, repeated names), deep nesting up
/// to the limit, long strings with escapes, escaped names: shape `shape` (0 to 8) of about
/// `size` bytes.
fn json_body(shape: u8, size: usize) -> (&'static str, Vec<u8>) {
    {
        let (name, body) = match shape {
            0 => ("members in order", {
                let mut s = String::from("{");
                let mut i = 0u64;
                while s.len() < size {
                    s.push_str(&format!("\"{i:08}\":0,"));
                    i += 1;
                }
                s.push_str("\"~\":0}");
                s
            }),
            1 => ("members out of order", {
                let mut s = String::from("{");
                let mut i = u64::MAX;
                while s.len() < size {
                    s.push_str(&format!("\"{i:x}\":0,"));
                    i -= 1;
                }
                s.push_str("\"\":0}");
                s
            }),
            2 => ("one name repeated", {
                let mut s = String::from("{");
                s.push_str(&"\"a\":0,".repeat(size / 6));
                s.push_str("\"a\":1}");
                s
            }),
            3 => ("deep arrays", {
                let unit = format!("{}{},", "[".repeat(126), "]".repeat(126));
                format!("[{}0]", unit.repeat(size / unit.len()))
            }),
            4 => ("deep objects out of order", {
                let unit = format!("{}1{},", "{\"b\":0,\"a\":".repeat(126), "}".repeat(126));
                format!("[{}0]", unit.repeat(size / unit.len()))
            }),
            5 => ("long string with escapes", {
                format!(
                    "[\"{}\"]",
                    "\\n\\u00e9\\ud83d\\ude00a\\\"".repeat(size / 27)
                )
            }),
            6 => ("escaped names out of order", {
                let mut s = String::from("{");
                let mut i = u32::MAX;
                while s.len() < size {
                    s.push_str(&format!("\"\\u0061\\n{i:x}\":\"\\t\",", i = i));
                    i -= 1;
                }
                s.push_str("\"\":0}");
                s
            }),
            7 => ("empty members", {
                let mut s = String::from("[");
                s.push_str(&"{},".repeat(size / 3));
                s.push_str("[]]");
                s
            }),
            _ => ("small arrays of numbers", {
                let mut s = String::from("[");
                s.push_str(&"[1,-0.5,true,null],".repeat(size / 20));
                s.push_str("0]");
                s
            }),
        };
        (name, body.into_bytes())
    }
}

#[test]
fn form_fingerprint_memory_is_bounded() {
    // The shape the issue measured first: 2 MiB of `&a`.
    check("form &a x 2 MiB", FORM, &repeat("&a", 2 << 20));
    check(
        "form descending names x 2 MiB",
        FORM,
        &descending_fields(2 << 20),
    );
    runner()
        .run(&form_body(), |(unit, size)| {
            check(
                &format!("form {unit:?} x {size}"),
                FORM,
                &repeat(&unit, size),
            );
            Ok(())
        })
        .unwrap();
}

#[test]
fn json_fingerprint_memory_is_bounded() {
    runner()
        .run(&(0..9u8, size()), |(shape, size)| {
            let (name, body) = json_body(shape, size);
            let shape = format!("json {name}, {size} bytes");
            prop_assert!(
                idempotent_core::fingerprint::canonical_json(&body).is_some(),
                "{shape}: not JSON"
            );
            check(&shape, JSON, &body);
            Ok(())
        })
        .unwrap();
}
