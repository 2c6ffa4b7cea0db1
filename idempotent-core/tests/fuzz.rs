//! Fuzzing on stable Rust: proptest targets for everything that parses untrusted input (the
//! key parser, the JSON and form canonicalisers, the duration parser), each checking more
//! than "does not panic" (proptest reports a panic in a target as a failure, with the input
//! shrunk).
//!
//! By default each target runs a short bounded pass (`FUZZ_CASES`, default 2,000 cases), which
//! is what CI runs. For a long campaign give each target a time budget:
//!
//! ```text
//! FUZZ_SECONDS=600 cargo test --release -p idempotent-core --test fuzz -- --test-threads 1 --nocapture
//! ```
//!
//! Every target prints how many cases it ran. A failure prints the shrunk input; proptest's
//! seed for a run comes from the system, so two runs explore different inputs
//! (`PROPTEST_RNG_SEED` pins one).
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_core::http::MAX_KEY_LEN;
use idempotent_core::{fingerprint::*, *};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::time::{Duration, Instant};

/// Runs `check` on values of `strategy`: `FUZZ_CASES` cases (default 2,000), or batches of
/// 10,000 until its share of `FUZZ_SECONDS` has passed (a test fuzzing `parts` strategies
/// gives each `1/parts` of the budget, so every test takes `FUZZ_SECONDS`).
fn fuzz<S: Strategy>(
    name: &str,
    parts: u32,
    strategy: S,
    check: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let env = |var: &str| std::env::var(var).ok().and_then(|v| v.parse::<u64>().ok());
    let budget = env("FUZZ_SECONDS").map(|s| Duration::from_secs(s) / parts.max(1));
    let batch = if budget.is_some() {
        10_000
    } else {
        env("FUZZ_CASES").unwrap_or(2_000)
    };
    let start = Instant::now();
    let mut ran = 0_u64;
    loop {
        let mut runner = TestRunner::new(Config {
            cases: u32::try_from(batch).unwrap_or(u32::MAX),
            failure_persistence: None,
            max_global_rejects: u32::MAX,
            ..Config::default()
        });
        if let Err(failure) = runner.run(&strategy, &check) {
            panic!("fuzz target {name} failed after {ran} cases: {failure}");
        }
        ran += batch;
        match budget {
            Some(b) if start.elapsed() < b => {}
            _ => break,
        }
    }
    println!(
        "fuzz target {name}: {ran} cases in {:.1}s, no failure",
        start.elapsed().as_secs_f64()
    );
}

// ---------------------------------------------------------------------------------------------
// The key parser

/// Header values: arbitrary bytes, and quoted strings built from the characters that matter
/// to sf-string parsing (quotes, backslashes, parameters, whitespace, control and non-ASCII
/// bytes), sometimes with a parameter or an unclosed quote.
fn header_value() -> impl Strategy<Value = Vec<u8>> {
    let interesting =
        prop::sample::select(b"ab09-_\"\\;=, \t\x00\x01\x7f\x80\xc3\xa9\xff".to_vec());
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..400),
        (
            prop::collection::vec(interesting, 0..300),
            any::<bool>(),
            prop::sample::select(vec!["", ";a=1", ";", " ;x", "\"", "\"\""]),
        )
            .prop_map(|(inner, close, tail)| {
                let mut v = vec![b'"'];
                v.extend(inner);
                if close {
                    v.push(b'"');
                }
                v.extend(tail.as_bytes());
                v
            }),
        "[!-~]{1,300}".prop_map(String::into_bytes),
    ]
}

#[test]
fn fuzz_key_parser() {
    fuzz("key parser", 1, header_value(), |value| {
        let trimmed: &[u8] = {
            let start = value.iter().position(|b| *b != b' ' && *b != b'\t');
            let end = value.iter().rposition(|b| *b != b' ' && *b != b'\t');
            match (start, end) {
                (Some(s), Some(e)) => &value[s..=e],
                _ => &[],
            }
        };
        match IdempotencyKey::parse(&value) {
            Ok(key) => {
                let s = key.as_str();
                prop_assert!(!s.is_empty() && s.len() <= MAX_KEY_LEN, "{s:?}");
                prop_assert!(s.bytes().all(|b| b.is_ascii_graphic()), "{s:?}");
                if trimmed.first() != Some(&b'"') {
                    // The bare (Stripe) form is the value itself.
                    prop_assert_eq!(s.as_bytes(), trimmed);
                }
                // The sf-string form parses back to the same key.
                let again = IdempotencyKey::parse(key.to_sf_string().as_bytes());
                prop_assert_eq!(again.as_ref(), Ok(&key));
            }
            Err(KeyError::Missing | KeyError::Multiple { .. }) => {
                prop_assert!(false, "one value cannot be missing or several");
            }
            Err(_) => {}
        }
        // Two lines are refused, whatever they hold.
        prop_assert_eq!(
            IdempotencyKey::from_header_values([&value[..], b"k"]),
            Err(KeyError::Multiple { count: 2 })
        );
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// The JSON canonicaliser

/// What the canonicaliser must agree with: `serde_json` parsing, `serde_jcs` writing.
fn oracle(body: &[u8]) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    serde_jcs::to_vec(&value).ok()
}

fn json_number() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| format!("{f:e}")),
        // Huge and long numbers: beyond i64 and u64, beyond a double's precision and range.
        (
            "-?[1-9][0-9]{0,400}",
            "(\\.[0-9]{1,40})?",
            "([eE][+-]?[0-9]{1,4})?"
        )
            .prop_map(|(i, f, e)| format!("{i}{f}{e}")),
    ]
}

fn json_string() -> impl Strategy<Value = String> {
    prop_oneof![
        "[ -~\u{e9}\u{20ac}\u{1f600}]{0,8}".prop_map(|s| serde_json::to_string(&s).unwrap()),
        // Escapes, lone surrogates included.
        prop::collection::vec(
            prop::sample::select(vec![
                "a",
                "\\n",
                "\\\"",
                "\\\\",
                "\\u00e9",
                "\\ud83d\\ude00",
                "\\ud800",
                "\\udc00",
                "\\/",
            ]),
            0..6
        )
        .prop_map(|parts| format!("\"{}\"", parts.concat())),
    ]
}

fn json_text() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        json_number(),
        json_string(),
    ];
    leaf.prop_recursive(5, 48, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(|v| format!("[{}]", v.join(", "))),
            // Names from a small set, so duplicate members are common.
            prop::collection::vec(
                (prop::sample::select(vec!["a", "b", "é", "\\u0061"]), inner),
                0..5
            )
            .prop_map(|m| {
                let members: Vec<String> = m
                    .into_iter()
                    .map(|(k, v)| format!("\"{k}\" :{v}"))
                    .collect();
                format!("{{ {} }}", members.join(",\n"))
            }),
        ]
    })
}

/// Valid texts, texts with a byte changed, removed or inserted, and arbitrary bytes.
fn json_input() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        json_text().prop_map(String::into_bytes),
        (
            json_text(),
            any::<prop::sample::Index>(),
            any::<u8>(),
            0..3_u8
        )
            .prop_map(|(text, at, byte, how)| {
                let mut bytes = text.into_bytes();
                let i = at.index(bytes.len() + 1);
                match how {
                    0 if i < bytes.len() => bytes[i] = byte,
                    1 if i < bytes.len() => {
                        bytes.remove(i);
                    }
                    _ => bytes.insert(i, byte),
                }
                bytes
            }),
        prop::collection::vec(any::<u8>(), 0..300),
    ]
}

#[test]
fn fuzz_json_canonicaliser() {
    fuzz("JSON canonicaliser", 1, json_input(), |body| {
        let ours = canonical_json(&body);
        let theirs = oracle(&body);
        prop_assert_eq!(
            ours.as_deref().map(String::from_utf8_lossy),
            theirs.as_deref().map(String::from_utf8_lossy),
            "input {:?}",
            String::from_utf8_lossy(&body)
        );
        if let Some(canon) = ours {
            // A fixed point.
            let again = canonical_json(&canon);
            prop_assert_eq!(again.as_deref(), Some(&canon[..]));
        }
        Ok(())
    });
}

/// Deep nesting, closed or not, arrays and objects mixed: never a stack overflow; refused past
/// 127 levels, accepted up to them when well formed.
#[test]
fn fuzz_json_nesting() {
    let levels = prop::collection::vec(any::<bool>(), 0..5_000);
    fuzz(
        "JSON nesting",
        1,
        (levels, any::<bool>()),
        |(levels, closed)| {
            let mut text = String::new();
            for &array in &levels {
                text.push_str(if array { "[" } else { "{\"k\":" });
            }
            text.push('1');
            if closed {
                for &array in levels.iter().rev() {
                    text.push(if array { ']' } else { '}' });
                }
            }
            let ours = canonical_json(text.as_bytes());
            let well_formed = closed || levels.is_empty();
            prop_assert_eq!(
                ours.is_some(),
                well_formed && levels.len() <= 127,
                "depth {}",
                levels.len()
            );
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// The form canonicaliser

/// A byte that form encoding treats specially, or any byte.
fn form_byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        prop::sample::select(b"&=+%aAzZ09*-._ ~/".to_vec()),
        prop::sample::select(b"0123456789abcdefABCDEF".to_vec()),
        any::<u8>(),
    ]
}

/// Each byte of `s` written one of the ways a form may carry it: as itself where that is
/// unambiguous, percent-encoded in either case of hex, or `+` for a space.
fn spellings(s: &[u8]) -> impl Strategy<Value = String> + use<> {
    let s = s.to_vec();
    prop::collection::vec(0..3_u8, s.len()).prop_map(move |choice| {
        s.iter()
            .zip(choice)
            .map(|(&b, c)| match (b, c) {
                (b' ', 0) => "+".to_owned(),
                (b, 0) if b.is_ascii_alphanumeric() => (b as char).to_string(),
                (b, 1) => format!("%{b:02x}"),
                (b, _) => format!("%{b:02X}"),
            })
            .collect()
    })
}

#[test]
fn fuzz_form_canonicaliser() {
    // Arbitrary bodies: no panic, and the canonical form is a fixed point.
    fuzz(
        "form canonicaliser (bytes)",
        2,
        prop::collection::vec(form_byte(), 0..400),
        |body| {
            let canon = canonical_form(&body);
            prop_assert_eq!(canonical_form(&canon), canon);
            Ok(())
        },
    );
    // One field's name and value spelled two ways canonicalise alike; another field moved in
    // front of it does not matter.
    // (A field named `zz` would be a repeated field with the other one, whose values' order
    // matters: the first campaign found that case, a fault of this property, not of the code.)
    let field = (
        prop::collection::vec(any::<u8>(), 1..8).prop_filter("not the other field", |n| n != b"zz"),
        prop::collection::vec(any::<u8>(), 0..8),
    );
    let pair = field.prop_flat_map(|(name, value)| {
        (
            spellings(&name),
            spellings(&value),
            spellings(&name),
            spellings(&value),
        )
    });
    fuzz(
        "form canonicaliser (spellings)",
        2,
        pair,
        |(n1, v1, n2, v2)| {
            let a = canonical_form(format!("{n1}={v1}&zz=1").as_bytes());
            let b = canonical_form(format!("zz=1&{n2}={v2}").as_bytes());
            prop_assert_eq!(a, b);
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// The duration parser

const UNITS: [(&str, u128); 5] = [
    ("ms", 1),
    ("s", 1_000),
    ("m", 60_000),
    ("h", 3_600_000),
    ("d", 86_400_000),
];

#[test]
fn fuzz_duration_parser() {
    // Anything at all: no panic; accepted only when it is digits and a unit.
    fuzz(
        "duration parser (text)",
        2,
        "\\PC{0,24}|[0-9]{0,25}[a-zA-Z ]{0,3}",
        |text| {
            if let Ok(d) = parse_duration(&text) {
                prop_assert!(!d.is_zero());
                let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
                prop_assert!(
                    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()),
                    "{text:?}"
                );
                // (That its formatted form parses back is `duration.rs`'s own test.)
            }
            Ok(())
        },
    );
    // Digits and a unit: exactly the arithmetic, with zero and overflow refused.
    let unit = prop::sample::select(UNITS.to_vec());
    fuzz(
        "duration parser (values)",
        2,
        ("[0-9]{1,25}", unit),
        |(digits, (unit, per))| {
            let text = format!("{digits}{unit}");
            let millis = digits.parse::<u128>().ok().and_then(|n| n.checked_mul(per));
            match (parse_duration(&text), millis) {
                (Ok(d), Some(ms)) => prop_assert_eq!(d.as_millis(), ms),
                (Err(DurationError::Zero { .. }), Some(0)) => {}
                (Err(DurationError::Overflow { .. }), ms) => {
                    prop_assert!(ms.is_none_or(|ms| ms > u128::from(u64::MAX)), "{text}");
                }
                (other, ms) => prop_assert!(false, "{text}: {other:?} for {ms:?} ms"),
            }
            Ok(())
        },
    );
}
