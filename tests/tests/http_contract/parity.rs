//! Wire parity: everything the library itself writes is the same on both frameworks, byte for
//! byte (`wire_parity`).

use crate::{Fw, Server, config, head, key, limited, raw, serve, serve_wired};
use idempotent_core::MemoryStore;
use idempotent_core::http::Config;
use serde_json::Value;
use std::time::Duration;

/// A response as `wire_parity` compares it: the status, every header but the framing ones and
/// `Date` (grouped by name, values in order; the order *between* names is not compared, since
/// actix's header map does not keep it), and the body.
type Snapshot = (u16, Vec<(String, Vec<String>)>, bytes_body::Body);

mod bytes_body {
    /// A body, printed as text when it is text.
    #[derive(PartialEq, Eq)]
    pub(crate) struct Body(pub(crate) Vec<u8>);
    impl std::fmt::Debug for Body {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{:?}", String::from_utf8_lossy(&self.0))
        }
    }
}

async fn snapshot(res: reqwest::Response) -> Snapshot {
    const FRAMING: [&str; 5] = [
        "date",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
    ];
    let status = res.status().as_u16();
    let mut headers: Vec<(String, Vec<String>)> = Vec::new();
    for name in res.headers().keys() {
        if FRAMING.contains(&name.as_str()) {
            continue;
        }
        let values = res
            .headers()
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap_or("<binary>").to_owned())
            .collect();
        headers.push((name.as_str().to_owned(), values));
    }
    headers.sort();
    (
        status,
        headers,
        bytes_body::Body(res.bytes().await.unwrap().to_vec()),
    )
}

/// Status and body of a raw HTTP/1.1 answer.
fn raw_parts(answer: &str) -> (String, String) {
    let status = answer.lines().next().unwrap_or_default().to_owned();
    let body = answer
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or_default()
        .to_owned();
    (status, body)
}

/// Everything the library itself writes is the same on both frameworks, byte for byte:
/// statuses, problem bodies, our headers, stored-header sets and replays (`Date`, framing and
/// the order between different header names are not compared). Both servers run the same
/// handlers, so first executions compare whole too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_parity() {
    let pair = |config: fn() -> Config| async move {
        (
            serve(Fw::Axum, config()).await,
            serve(Fw::Actix, config()).await,
        )
    };
    let (axum, actix) = pair(|| limited(MemoryStore::new())).await;
    let k = key();
    type Case<'a> = (
        &'a str,
        Box<dyn Fn(&Server) -> reqwest::RequestBuilder + 'a>,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            "first",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#)),
        ),
        (
            "replay",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(&k), r#"{ "amount":1 }"#)),
        ),
        (
            "mismatch",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 2}"#)),
        ),
        (
            "other route",
            Box::new(|s| s.post("/v1/refunds", "acct_a", Some(&k), r#"{"amount": 1}"#)),
        ),
        (
            "missing",
            Box::new(|s| s.post("/v1/charges", "acct_a", None, "{}")),
        ),
        (
            "empty",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(""), "{}")),
        ),
        (
            "quoting",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some("\"open"), "{}")),
        ),
        (
            "too long",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(&"k".repeat(256)), "{}")),
        ),
        (
            "two keys",
            Box::new(|s| {
                s.post("/v1/charges", "acct_a", Some("a"), "{}")
                    .header("idempotency-key", "b")
            }),
        ),
        (
            "413",
            Box::new(|s| s.raw_post("/echo", "big-body", "text/plain", &"y".repeat(2048))),
        ),
        (
            "410 first",
            Box::new(|s| s.raw_post("/big", "big-1", "text/plain", "")),
        ),
        (
            "410",
            Box::new(|s| s.raw_post("/big", "big-1", "text/plain", "")),
        ),
        (
            "stream first",
            Box::new(|s| s.raw_post("/stream/ok", "stream-1", "text/plain", "")),
        ),
        (
            "stream replay",
            Box::new(|s| s.raw_post("/stream/ok", "stream-1", "text/plain", "")),
        ),
        (
            "5xx released",
            Box::new(|s| {
                s.post(
                    "/v1/charges",
                    "acct_a",
                    Some("bad-gateway"),
                    r#"{"amount": 500}"#,
                )
            }),
        ),
    ];
    for (name, case) in &cases {
        let a = snapshot(case(&axum).send().await.unwrap()).await;
        let b = snapshot(case(&actix).send().await.unwrap()).await;
        assert_eq!(a, b, "{name}: axum vs actix");
    }
    // An unreadable body: status line and problem body.
    let broken = format!(
        "{}zz\r\nnot a chunk\r\n\r\n",
        head("idempotency-key: k1\r\n", "transfer-encoding: chunked\r\n")
    );
    assert_eq!(
        raw_parts(&raw(axum.addr, broken.as_bytes()).await),
        raw_parts(&raw(actix.addr, broken.as_bytes()).await),
        "400 unreadable body"
    );
    // A missing key's 400 as sent, line by line: the same but for what README.md's Set-up says
    // differs, `date`, the order of the header lines, and actix's `connection: close` (actix-http
    // closes a connection whose request body it answered unread; hyper reads the small body it
    // already has and keeps the connection).
    let missing = format!("{}{{}}", head("", "content-length: 2\r\n"));
    let lines = |answer: String| {
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        let mut lines: Vec<String> = head
            .split("\r\n")
            .filter(|l| !l.starts_with("date: "))
            .map(str::to_owned)
            .collect();
        lines[1..].sort();
        (lines, body.to_owned())
    };
    let on_axum = lines(raw(axum.addr, missing.as_bytes()).await);
    let mut on_actix = lines(raw(actix.addr, missing.as_bytes()).await);
    let close = on_actix.0.iter().position(|l| l == "connection: close");
    on_actix
        .0
        .remove(close.expect("actix's connection: close is gone: update README.md"));
    assert_eq!(on_axum, on_actix, "400 missing key, on the wire");
    // 409 while the first attempt runs: same problem, Retry-After within a second.
    let k = key();
    let slow = |s: &Server| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#);
    let (first_a, first_b) = (
        tokio::spawn(slow(&axum).send()),
        tokio::spawn(slow(&actix).send()),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status_a, headers_a, body_a) = snapshot(slow(&axum).send().await.unwrap()).await;
    let (status_b, headers_b, body_b) = snapshot(slow(&actix).send().await.unwrap()).await;
    assert_eq!((status_a, status_b), (409, 409));
    let without = |h: &[(String, Vec<String>)], name: &str| {
        h.iter()
            .filter(|(n, _)| n != name)
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        without(&headers_a, "retry-after"),
        without(&headers_b, "retry-after")
    );
    let secs = |h: &[(String, Vec<String>)]| -> i64 {
        h.iter().find(|(n, _)| n == "retry-after").unwrap().1[0]
            .parse()
            .unwrap()
    };
    assert!((secs(&headers_a) - secs(&headers_b)).abs() <= 1);
    let detail_free = |b: &[u8]| {
        let mut v: Value = serde_json::from_slice(b).unwrap();
        v["detail"] = Value::Null; // carries the seconds left, which differ by timing
        v
    };
    assert_eq!(detail_free(&body_a.0), detail_free(&body_b.0));
    first_a.await.unwrap().unwrap();
    first_b.await.unwrap().unwrap();

    // 503 store unavailable, 503 shutting down, 500 misconfigured.
    let (axum, actix) = pair(|| config(MemoryStore::builder().max_entries(0).build())).await;
    let unavailable = |s: &Server| s.post("/v1/charges", "acct_a", Some("u"), r#"{"amount": 1}"#);
    assert_eq!(
        snapshot(unavailable(&axum).send().await.unwrap()).await,
        snapshot(unavailable(&actix).send().await.unwrap()).await,
        "503 store unavailable"
    );
    let (axum, actix) = pair(|| config(MemoryStore::new())).await;
    axum.engine.drain(Duration::from_millis(10)).await;
    actix.engine.drain(Duration::from_millis(10)).await;
    let draining = |s: &Server| s.post("/v1/charges", "acct_a", Some("d"), r#"{"amount": 1}"#);
    assert_eq!(
        snapshot(draining(&axum).send().await.unwrap()).await,
        snapshot(draining(&actix).send().await.unwrap()).await,
        "503 shutting down"
    );
    let axum = serve_wired(Fw::Axum, config(MemoryStore::new()), false).await;
    let actix = serve_wired(Fw::Actix, config(MemoryStore::new()), false).await;
    let unwired = |s: &Server| s.post("/v1/refunds", "acct_a", Some("m"), "{}");
    assert_eq!(
        snapshot(unwired(&axum).send().await.unwrap()).await,
        snapshot(unwired(&actix).send().await.unwrap()).await,
        "500 misconfigured"
    );
}
