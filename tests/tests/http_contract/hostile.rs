//! Hostile input, on both frameworks through real servers (raw TCP where a well-behaved client
//! could not send the bytes): each case is refused with a clear answer, or served correctly,
//! and never panics, claims a key it should not, or runs a handler twice. The server answers
//! a normal request afterwards, so nothing hostile took it down.

use super::{Fw, config, head, key, problem, raw, serve};
use idempotent_core::http::{Config, ConfigBuilder};
use idempotent_core::{Engine, MemoryStore};
use idempotent_tests::faults::FaultyStore;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The status line's code of a raw answer.
fn status(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"))
}

/// The head of a charge POST with `line` (exact bytes) among its headers and a 2-byte body
/// declared.
fn request_with(line: &[u8]) -> Vec<u8> {
    [
        b"POST /v1/charges HTTP/1.1\r\nhost: x\r\nauthorization: Bearer acct_a\r\ncontent-type: application/json\r\n".as_slice(),
        line,
        b"content-length: 2\r\n\r\n",
    ]
    .concat()
}

/// A normal charge still works (the server survived).
async fn still_serves(s: &super::Server) {
    let res = s
        .post("/v1/charges", "acct_a", Some(&key()), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
}

/// Keys no client should send: each is a 400 before anything is claimed or run. Where the
/// bytes are not even a valid HTTP header value (control characters), the framework's own
/// parser refuses the request with a 400 before it reaches us; everything that parses as a
/// header reaches our parser and gets our problem.
pub(crate) async fn hostile_keys_are_400_and_claim_nothing(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, config(store.clone())).await;
    let long = "k".repeat(256);
    let very_long = "k".repeat(60_000);
    let ours: Vec<(&str, Vec<u8>)> = vec![
        (
            "256 characters",
            format!("idempotency-key: {long}\r\n").into_bytes(),
        ),
        (
            "60,000 characters",
            format!("idempotency-key: {very_long}\r\n").into_bytes(),
        ),
        (
            "256 characters quoted",
            format!("idempotency-key: \"{long}\"\r\n").into_bytes(),
        ),
        ("a tab inside", b"idempotency-key: a\tb\r\n".to_vec()),
        (
            "non-ASCII (UTF-8)",
            "idempotency-key: caf\u{e9}\r\n".as_bytes().to_vec(),
        ),
        (
            "non-ASCII (Latin-1 byte)",
            b"idempotency-key: caf\xe9\r\n".to_vec(),
        ),
        (
            "two lines",
            b"idempotency-key: one\r\nidempotency-key: one\r\n".to_vec(),
        ),
        ("a bad escape", b"idempotency-key: \"a\\qb\"\r\n".to_vec()),
        (
            "an escaped control",
            b"idempotency-key: \"a\\\tb\"\r\n".to_vec(),
        ),
        (
            "an sf-string with a parameter",
            b"idempotency-key: \"abc\";x=1\r\n".to_vec(),
        ),
        (
            "an sf-string with an empty parameter",
            b"idempotency-key: \"abc\";\r\n".to_vec(),
        ),
        (
            "an unterminated sf-string",
            b"idempotency-key: \"abc\r\n".to_vec(),
        ),
        ("an empty sf-string", b"idempotency-key: \"\"\r\n".to_vec()),
        ("empty", b"idempotency-key: \r\n".to_vec()),
    ];
    for (what, line) in &ours {
        let mut request = request_with(line);
        request.extend_from_slice(b"{}");
        let answer = raw(s.addr, &request).await;
        assert_eq!(status(&answer), 400, "{what}: {answer}");
        assert!(
            answer.contains("idempotency-key-invalid")
                || answer.contains("idempotency-key-missing"),
            "{what}: not our problem: {answer}"
        );
        assert!(
            answer.contains("application/problem+json"),
            "{what}: {answer}"
        );
    }
    // Control characters and DEL are not HTTP header bytes at all: the framework refuses them.
    for (what, line) in [
        ("a control character", &b"idempotency-key: a\x01b\r\n"[..]),
        ("DEL", &b"idempotency-key: a\x7fb\r\n"[..]),
        ("NUL", &b"idempotency-key: a\x00b\r\n"[..]),
    ] {
        let mut request = request_with(line);
        request.extend_from_slice(b"{}");
        let answer = raw(s.addr, &request).await;
        assert_eq!(status(&answer), 400, "{what}: {answer}");
    }
    assert_eq!(
        (store.claims(), s.runs()),
        (0, 0),
        "nothing claimed, nothing ran"
    );
    still_serves(&s).await;
}

/// Thousands of header lines: the framework's header limit refuses the request (431 on both:
/// hyper's and actix-http's limits of about a hundred lines) before the idempotency layer runs, so nothing is claimed; fifty
/// `Idempotency-Key` lines within the limit are our 400 (several lines).
pub(crate) async fn thousands_of_headers_are_refused_cleanly(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, config(store.clone())).await;
    let many: String = (0..5_000).map(|i| format!("x-h{i}: v\r\n")).collect();
    let request = format!(
        "{}{{}}",
        head(
            "idempotency-key: k1\r\n",
            &format!("{many}content-length: 2\r\n")
        )
    );
    let answer = raw(s.addr, request.as_bytes()).await;
    assert_eq!(status(&answer), 431, "{answer}");
    let keys: String = (0..50)
        .map(|i| format!("idempotency-key: k{i}\r\n"))
        .collect();
    let request = format!("{}{{}}", head(&keys, "content-length: 2\r\n"));
    let answer = raw(s.addr, request.as_bytes()).await;
    assert_eq!(status(&answer), 400, "{answer}");
    assert!(answer.contains("idempotency-key-invalid"), "{answer}");
    assert_eq!((store.claims(), s.runs()), (0, 0));
    still_serves(&s).await;
}

/// A body sent a byte at a time, slower than the configured read timeout (slowloris): a 408
/// problem once the timeout passes, nothing claimed; the same key with the whole body then
/// runs normally.
pub(crate) async fn slow_bodies_time_out_and_claim_nothing(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let config: Config = ConfigBuilder::<Config>::new(Engine::new(store.clone()))
        .request_body_timeout(Duration::from_millis(600))
        .build()
        .unwrap();
    let s = serve(fw, config).await;
    let k = key();
    let body = br#"{"amount": 1234567}"#;
    let mut conn = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let start = Instant::now();
    conn.write_all(
        head(
            &format!("idempotency-key: {k}\r\n"),
            &format!("content-length: {}\r\n", body.len()),
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut sent = 0;
    let mut out = Vec::new();
    let mut buf = [0_u8; 4096];
    // Dribble one byte every 150 ms while watching for the answer.
    while start.elapsed() < Duration::from_secs(5) {
        if sent < body.len() - 1 {
            if conn.write_all(&body[sent..=sent]).await.is_err() {
                break;
            }
            sent += 1;
        }
        match tokio::time::timeout(Duration::from_millis(150), conn.read(&mut buf)).await {
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => {
                out.extend_from_slice(&buf[..n]);
                if String::from_utf8_lossy(&out).contains("}") {
                    break;
                }
            }
            Ok(Err(_)) => break,
            Err(_) => {}
        }
    }
    let answer = String::from_utf8_lossy(&out).into_owned();
    assert_eq!(status(&answer), 408, "{answer}");
    assert!(answer.contains("idempotency-request-timeout"), "{answer}");
    assert!(
        sent < body.len() - 1,
        "the timeout fired before the body was complete ({sent} bytes sent)"
    );
    assert_eq!((store.claims(), s.runs()), (0, 0));
    // The server let go of the connection: nothing more is read from it or written to it.
    let closed = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection stayed open after the 408");
    // The key was never claimed: the whole request runs.
    let res = s
        .post(
            "/v1/charges",
            "acct_a",
            Some(&k),
            std::str::from_utf8(body).unwrap(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(res.headers()["idempotent-replayed"], "false");
    assert_eq!(s.runs(), 1);
}

/// JSON bodies built to hurt: deep nesting (no stack overflow: past 127 levels the body is
/// fingerprinted as raw bytes, so it is still protected), duplicate member names (the last
/// wins, as in `JSON.parse` and JCS: `{"a":1,"a":2}` is `{"a":2}`), numbers beyond a double
/// (`1e400` is not canonical JSON, fingerprinted raw) and integers beyond 2^53 (compared as
/// the doubles JCS makes of them).
pub(crate) async fn hostile_json_is_fingerprinted_without_harm(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    let json = |k: &str, body: String| {
        s.client
            .post(format!("{}/echo", s.base))
            .header("idempotency-key", k)
            .header("content-type", "application/json")
            .body(body)
    };
    let replayed = |res: &reqwest::Response| res.headers()["idempotent-replayed"] == "true";
    // 100,000 levels: the canonicaliser refuses it without recursing; the raw bytes are the
    // fingerprint, so the same body replays and one level less is another request.
    let deep = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
    let k = key();
    let first = json(&k, deep(100_000)).send().await.unwrap();
    assert_eq!(first.status(), 200);
    assert!(!replayed(&first));
    let again = json(&k, deep(100_000)).send().await.unwrap();
    assert!(replayed(&again));
    problem(
        json(&k, deep(99_999)).send().await.unwrap(),
        422,
        "idempotency-key-mismatch",
    )
    .await;
    // Unclosed nesting, too.
    let open = json(&key(), "[".repeat(200_000)).send().await.unwrap();
    assert_eq!(open.status(), 200);
    // Duplicate names: the last one wins.
    let k = key();
    assert!(!replayed(
        &json(&k, r#"{"a":1,"a":2}"#.into()).send().await.unwrap()
    ));
    assert!(replayed(
        &json(&k, r#"{ "a" : 2 }"#.into()).send().await.unwrap()
    ));
    problem(
        json(&k, r#"{"a":2,"a":1}"#.into()).send().await.unwrap(),
        422,
        "idempotency-key-mismatch",
    )
    .await;
    // Beyond a double: raw bytes, so each spelling is its own request.
    let k = key();
    assert!(!replayed(&json(&k, "[1e400]".into()).send().await.unwrap()));
    assert!(replayed(&json(&k, "[1e400]".into()).send().await.unwrap()));
    problem(
        json(&k, "[1e401]".into()).send().await.unwrap(),
        422,
        "idempotency-key-mismatch",
    )
    .await;
    // A 300-digit integer is a finite double; integers that round to one double are one
    // request (JCS compares numbers as doubles), and a different double is a mismatch.
    let k = key();
    let big = format!("[1{}]", "0".repeat(299));
    assert!(!replayed(&json(&k, big.clone()).send().await.unwrap()));
    assert!(replayed(&json(&k, "[1e299]".into()).send().await.unwrap()));
    problem(
        json(&k, "[2e299]".into()).send().await.unwrap(),
        422,
        "idempotency-key-mismatch",
    )
    .await;
    let k = key();
    assert!(!replayed(
        &json(&k, "[9007199254740993]".into()).send().await.unwrap()
    ));
    assert!(replayed(
        &json(&k, "[9007199254740992]".into()).send().await.unwrap()
    ));
    assert_eq!(s.runs(), 6, "one run per distinct request");
}

/// A caller at its share of the memory store gets 503 with `Retry-After` for new keys, never
/// a run; its stored keys still replay, and other callers go on.
pub(crate) async fn one_caller_cannot_fill_the_memory_store(fw: Fw) {
    let store = MemoryStore::builder().max_per_scope(3).build();
    let s = serve(fw, config(store)).await;
    let charge =
        |account: &str, k: &str| s.post("/v1/charges", account, Some(k), r#"{"amount": 1}"#);
    for i in 0..3 {
        let res = charge("acct_greedy", &format!("k{i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
    }
    let full = charge("acct_greedy", "k3").send().await.unwrap();
    assert!(full.headers().contains_key("retry-after"));
    problem(full, 503, "idempotency-store-unavailable").await;
    let replay = charge("acct_greedy", "k0").send().await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let other = charge("acct_other", "k3").send().await.unwrap();
    assert_eq!(other.status(), 201);
    assert_eq!(s.runs(), 4, "the refused request never ran");
}

/// Scope and key values that a naive concatenation would join into one string stay apart:
/// account `a:b` with key `c` and account `a` with key `b:c` are two operations, each with its
/// own response.
pub(crate) async fn scope_and_key_values_never_collide(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    let refund = |account: &str, k: &str| s.post("/v1/refunds", account, Some(k), r#"{"n":1}"#);
    let first = refund("a:b", "c").send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.text().await.unwrap(), r#"refund for a:b: {"n":1}"#);
    let second = refund("a", "b:c").send().await.unwrap();
    assert_eq!(second.status(), 201);
    assert_eq!(second.headers()["idempotent-replayed"], "false");
    assert_eq!(second.text().await.unwrap(), r#"refund for a: {"n":1}"#);
    let third = refund("a:", "b:c").send().await.unwrap();
    assert_eq!(third.headers()["idempotent-replayed"], "false");
    // And each replays its own.
    let again = refund("a:b", "c").send().await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), r#"refund for a:b: {"n":1}"#);
}

/// A caller identity spelled like an idempotent function's namespace (`call:4:book:acme` is
/// function `book`'s for tenant `acme`, `call:4:book:` the unscoped `book`'s) is refused with
/// the scope problem (400), before anything is claimed or run: an HTTP caller can never hold
/// a function's records (pre-claiming a message id so that the consumer gets a mismatch).
pub(crate) async fn function_namespaces_are_no_caller_identity(fw: Fw) {
    let store = MemoryStore::new();
    let s = serve(fw, config(store.clone())).await;
    for account in ["call:4:book:acme", "call:4:book:", "call:"] {
        let res = s
            .post("/v1/charges", account, Some("msg_1"), r#"{"amount": 1}"#)
            .send()
            .await
            .unwrap();
        let body = problem(res, 400, "idempotency-scope-invalid").await;
        assert!(
            body["detail"].as_str().unwrap().contains("call:"),
            "{account}: {body}"
        );
    }
    assert_eq!(s.runs(), 0, "a refused caller's handler ran");
    assert_eq!(store.len(), 0, "a refused caller claimed a record");
    still_serves(&s).await;
}
