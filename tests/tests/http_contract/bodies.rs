//! Request bodies: admission before the claim (cheap rejections answer before a byte of the body
//! is read), the request limit (declared, chunked, decoded), the response limit and optional
//! keys, compressed bodies fingerprinted decoded, and unreadable or abandoned bodies, which claim
//! nothing.

use crate::{Fw, config, head, limited, problem, raw, serve};
use idempotent_core::MemoryStore;
use idempotent_tests::faults::FaultyStore;
use serde_json::Value;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// `body` gzipped with `mtime` in its header: the same JSON, other bytes.
fn gzip(body: &str, mtime: u32) -> Vec<u8> {
    use std::io::Write;
    let mut out = flate2::GzBuilder::new()
        .mtime(mtime)
        .write(Vec::new(), flate2::Compression::default());
    out.write_all(body.as_bytes()).unwrap();
    out.finish().unwrap()
}

/// A gzip body is fingerprinted decoded (actix-web's extractors decode it; on Axum,
/// tower-http's decompression layer does): a retry whose compressor wrote another timestamp
/// replays, the same key for another decoded body is 422, a body that does not decode is 400
/// and claims nothing, and the request limit applies to the decoded bytes (a zstd bomb is 413).
/// Both frameworks answer alike.
pub(crate) async fn compressed_bodies_are_fingerprinted_decoded(fw: Fw) {
    let s = serve(fw, limited(MemoryStore::new())).await;
    let send = |key: &str, body: Vec<u8>| {
        s.post("/v1/charges", "acct_a", Some(key), "")
            .header("content-encoding", "gzip")
            .body(body)
            .send()
    };
    let json = r#"{"amount": 40}"#;
    let first = send("gz", gzip(json, 1)).await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    let first: Value = first.json().await.unwrap();
    // Another timestamp, and the same JSON with its keys spaced otherwise.
    for retry in [gzip(json, 2), gzip(r#"{ "amount":40 }"#, 3)] {
        assert_ne!(retry, gzip(json, 1));
        let res = send("gz", retry).await.unwrap();
        assert_eq!(res.status(), 201, "{fw:?}: a recompressed retry");
        assert_eq!(res.headers()["idempotent-replayed"], "true");
        assert_eq!(res.json::<Value>().await.unwrap(), first);
    }
    assert_eq!(s.runs(), 1);
    // The plain body is the same request as its gzip.
    let res = s
        .post("/v1/charges", "acct_a", Some("gz"), json)
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["idempotent-replayed"], "true", "{fw:?}");
    problem(
        send("gz", gzip(r#"{"amount": 41}"#, 1)).await.unwrap(),
        422,
        "idempotency-key-mismatch",
    )
    .await;
    // Not gzip at all: 400 from the decoder (ours on Actix, tower-http's on Axum), no claim.
    let res = send("broken", b"not gzip".to_vec()).await.unwrap();
    assert_eq!(res.status(), 400, "{fw:?}");
    // Over the 1 KiB limit once decoded, though a few dozen bytes sent: 413.
    let big = format!(r#"{{"amount": 1, "pad": "{}"}}"#, "a".repeat(4096));
    let packed = gzip(&big, 1);
    assert!(packed.len() < 1024);
    problem(
        send("big", packed).await.unwrap(),
        413,
        "idempotency-request-too-large",
    )
    .await;
    // A bomb: a few hundred bytes of zstd that decode to 16 MiB. 413 once the decoded bytes
    // pass the limit; decoding stops there (actix-web's own decoder would build the whole
    // 16 MiB first).
    let bomb = zstd::encode_all(&vec![0_u8; 16 << 20][..], 19).unwrap();
    assert!(bomb.len() < 1024, "{}", bomb.len());
    let res = s
        .post("/v1/charges", "acct_a", Some("bomb"), "")
        .header("content-encoding", "zstd")
        .body(bomb)
        .send()
        .await
        .unwrap();
    problem(res, 413, "idempotency-request-too-large").await;
    assert_eq!(s.runs(), 1);
    // No failed request claimed its key.
    let res = send("broken", gzip(json, 9)).await.unwrap();
    assert_eq!(res.headers()["idempotent-replayed"], "false");
}

pub(crate) async fn oversized_responses_optional_keys_and_request_limits(fw: Fw) {
    let s = serve(fw, limited(MemoryStore::new())).await;
    // A response over the route's limit is returned in full, not stored; the retry gets 410
    // and the handler does not run again.
    let post = |path: &str, key: Option<&str>, body: String| {
        let mut r = s.client.post(format!("{}{path}", s.base)).body(body);
        if let Some(k) = key {
            r = r.header("idempotency-key", k);
        }
        r.send()
    };
    let first = post("/big", Some("big-1"), String::new()).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.text().await.unwrap().len(), 100);
    problem(
        post("/big", Some("big-1"), String::new()).await.unwrap(),
        410,
        "idempotency-response-not-stored",
    )
    .await;
    // key = "optional": no key runs unprotected every time; a key still protects.
    for _ in 0..2 {
        assert_eq!(
            post("/optional", None, String::new())
                .await
                .unwrap()
                .status(),
            204
        );
    }
    assert_eq!(s.runs(), 2);
    for _ in 0..2 {
        assert_eq!(
            post("/optional", Some("opt-1"), String::new())
                .await
                .unwrap()
                .status(),
            204
        );
    }
    assert_eq!(s.runs(), 3);
    problem(
        post("/optional", Some(""), String::new()).await.unwrap(),
        400,
        "idempotency-key-invalid",
    )
    .await;
    // Without a key the optional route runs unprotected: its body is the handler's business,
    // not refused by our limit.
    assert_eq!(
        post("/optional", None, "y".repeat(2048))
            .await
            .unwrap()
            .status(),
        204
    );
    assert_eq!(s.runs(), 4);
    // Bodies over the limit are refused before anything else.
    problem(
        post("/optional", Some("opt-2"), "y".repeat(2048))
            .await
            .unwrap(),
        413,
        "idempotency-request-too-large",
    )
    .await;
    assert_eq!(s.runs(), 4);
}

/// The cheap checks answer before a byte of the body is read, and no store is touched.
pub(crate) async fn cheap_rejections_come_first(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, limited(store.clone())).await;
    // A malformed key with a body that never comes: answered 400 at once.
    let answer = raw(
        s.addr,
        head("idempotency-key: \"bad\r\n", "content-length: 1000\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("idempotency-key-invalid"), "{answer}");
    // A missing key, likewise.
    let answer = raw(s.addr, head("", "content-length: 1000\r\n").as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("idempotency-key-missing"), "{answer}");
    // A declared length over the limit: 413 before reading.
    let answer = raw(
        s.addr,
        head("idempotency-key: k1\r\n", "content-length: 999999\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // A missing key and a body that is not JSON: the key's problem, not the body's.
    let res = s
        .post("/v1/charges", "acct_a", None, "{not json")
        .send()
        .await
        .unwrap();
    problem(res, 400, "idempotency-key-missing").await;
    assert_eq!((store.claims(), s.runs()), (0, 0));
}

/// A chunked body (no declared length) that passes the limit while it is read: 413.
pub(crate) async fn chunked_bodies_over_the_limit_are_413(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, limited(store.clone())).await;
    let chunk = "x".repeat(600);
    let request = format!(
        "{}258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n",
        head("idempotency-key: k1\r\n", "transfer-encoding: chunked\r\n")
    );
    let answer = raw(s.addr, request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("idempotency-request-too-large"), "{answer}");
    // Our limit answers before the handler's own extractors would refuse the request (no
    // credentials, a media type its JSON extractor refuses): the same order on both frameworks.
    let unauthenticated = format!(
        "POST /v1/charges HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\nidempotency-key: k2\r\ntransfer-encoding: chunked\r\n\r\n258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n"
    );
    let answer = raw(s.addr, unauthenticated.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("idempotency-request-too-large"), "{answer}");
    assert_eq!((store.claims(), s.runs()), (0, 0));
}

/// A body that cannot be read is a 400, not a 413; a client that disconnects mid-upload
/// causes no claim and no handler run.
pub(crate) async fn unreadable_bodies_are_400_and_claim_nothing(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, config(store.clone())).await;
    // Broken chunked framing.
    let request = format!(
        "{}zz\r\nnot a chunk\r\n\r\n",
        head("idempotency-key: k1\r\n", "transfer-encoding: chunked\r\n")
    );
    let answer = raw(s.addr, request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains("idempotency-request-body-invalid"),
        "{answer}"
    );
    // Half a body, then the client is gone.
    let mut conn = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let partial = format!(
        "{}{{\"amount\":",
        head("idempotency-key: k2\r\n", "content-length: 100\r\n")
    );
    conn.write_all(partial.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(conn);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.claims(), 0, "nothing was claimed");
    assert_eq!(s.runs(), 0, "nothing ran");
}
