//! Property tests: the key parser and the canonicalisers never panic and behave as specified.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_core::{fingerprint::*, *};
use proptest::prelude::*;

proptest! {
    #[test]
    fn key_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = IdempotencyKey::parse(&bytes);
    }

    #[test]
    fn valid_keys_round_trip(key in "[!-~]{1,255}") {
        let parsed = IdempotencyKey::parse(key.as_bytes());
        if key.starts_with('"') {
            // A leading quote means sf-string syntax; it must be well formed.
            prop_assume!(parsed.is_ok());
        }
        let parsed = parsed.unwrap();
        let quoted = IdempotencyKey::parse(parsed.to_sf_string().as_bytes()).unwrap();
        prop_assert_eq!(parsed, quoted);
    }

    #[test]
    fn canonical_json_is_idempotent_and_order_insensitive(
        entries in proptest::collection::btree_map("[a-z\u{e9}\u{20ac}]{1,6}", any_json(), 0..8)
    ) {
        let forward: Vec<String> = entries.iter()
            .map(|(k, v)| format!("{}:{}", serde_json::to_string(k).unwrap(), v)).collect();
        let a = format!("{{{}}}", forward.join(","));
        let b = format!("{{ {} }}", forward.iter().rev().cloned().collect::<Vec<_>>().join(" ,\n "));
        let ca = canonical_json(a.as_bytes()).unwrap();
        let cb = canonical_json(b.as_bytes()).unwrap();
        prop_assert_eq!(&ca, &cb);
        prop_assert_eq!(canonical_json(&ca).unwrap(), ca);
    }

    #[test]
    fn canonical_json_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = canonical_json(&bytes);
    }

    /// Moving fields around does not change the form, as long as each field's own values
    /// keep their order (a stable sort by descending name is such a move).
    #[test]
    fn canonical_form_is_idempotent_and_field_order_insensitive(
        pairs in proptest::collection::vec(("[a-c%+&=]{0,2}", "[a-z0-9 %+=&\u{e9}]{0,5}"), 0..8)
    ) {
        let encode = |ps: &[(String, String)]| form_encode(ps);
        let mut moved = pairs.clone();
        moved.sort_by(|a, b| b.0.cmp(&a.0));
        let a = canonical_form(encode(&pairs).as_bytes());
        let b = canonical_form(encode(&moved).as_bytes());
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(canonical_form(&a), a);
    }

    /// Swapping two different values of one repeated field changes the form.
    #[test]
    fn canonical_form_keeps_the_order_of_repeated_values(
        first in "[a-z0-9 %+=&\u{e9}]{0,5}",
        second in "[a-z0-9 %+=&\u{e9}]{0,5}",
        others in proptest::collection::vec(("[b-d]{1,2}", "[a-z]{0,3}"), 0..4),
    ) {
        prop_assume!(first != second);
        let mut forward = vec![("a".to_owned(), first.clone())];
        forward.extend(others.iter().cloned());
        forward.push(("a".to_owned(), second.clone()));
        let mut swapped = vec![("a".to_owned(), second)];
        swapped.extend(others);
        swapped.push(("a".to_owned(), first));
        prop_assert_ne!(
            canonical_form(form_encode(&forward).as_bytes()),
            canonical_form(form_encode(&swapped).as_bytes())
        );
    }

    #[test]
    fn canonical_form_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = canonical_form(&bytes);
    }
}

fn any_json() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| format!("{f:e}")),
        "[ -~]{0,8}".prop_map(|s| serde_json::to_string(&s).unwrap()),
        Just("null".to_string()),
        Just("[true,false]".to_string()),
    ]
}

fn form_encode(pairs: &[(String, String)]) -> String {
    let mut ser = String::new();
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            ser.push('&');
        }
        ser.push_str(&urlencode(k));
        ser.push('=');
        ser.push_str(&urlencode(v));
    }
    ser
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
