//! Clients that leave: one that times out while the handler runs and retries (the headline
//! case), one that gives up while the claim is on its way, and one that half-closes or resets
//! its connection mid-handler. The work runs once and its response is stored.

use crate::{Fw, Server, config, head, key, problem, serve};
use idempotent_core::MemoryStore;
use idempotent_tests::faults::FaultyStore;
use serde_json::Value;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The headline case: the client times out while the handler runs, then retries. The work
/// runs once: the retry gets 409 while it runs, then the stored response.
pub(crate) async fn client_timeout_then_retry(s: &Server) {
    let k = key();
    let before = s.runs();
    let gone = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    let err = gone.expect_err("the client gave up");
    assert!(err.is_timeout(), "the client timed out: {err}");
    // The handler (1.5 s) is still running on the server.
    let busy = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#)
        .send()
        .await
        .unwrap();
    assert!(
        busy.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );
    problem(busy, 409, "idempotency-key-in-progress").await;
    let done = s
        .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#))
        .await;
    assert_eq!(done.status(), 201);
    assert_eq!(done.headers()["idempotent-replayed"], "true");
    let body: Value = done.json().await.unwrap();
    assert_eq!(body["id"], format!("ch_{}", before + 1));
    assert_eq!(s.runs() - before, 1, "the work happened once");
}

/// The client gives up while the claim is on its way (committed, answer not yet back): the
/// handler still runs once and its response is stored, instead of the key sitting claimed and
/// unused until its lease ends.
pub(crate) async fn client_gone_during_the_claim_still_runs_the_handler(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, config(store.clone())).await;
    store.delay_claims(Duration::from_millis(300));
    let k = key();
    let gone = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#)
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(gone.unwrap_err().is_timeout());
    store.delay_claims(Duration::ZERO);
    let replay = s
        .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#))
        .await;
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(s.runs(), 1);
}

/// A client that sends its request and then half-closes (FIN) or resets (RST) the connection
/// while the handler runs: the execution completes once and its response is stored.
pub(crate) async fn client_gone_mid_handler_by_half_close_or_reset(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    for reset in [false, true] {
        let before = s.runs();
        let k = key();
        let body = r#"{"amount": 7}"#;
        let request = format!(
            "{}{body}",
            head(
                &format!("idempotency-key: {k}\r\n"),
                &format!("content-length: {}\r\n", body.len())
            )
        );
        let mut conn = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        conn.write_all(request.as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        if reset {
            // A zero linger makes the close a reset (RST) at once; nothing blocks on it.
            #[allow(deprecated)]
            conn.set_linger(Some(Duration::ZERO)).unwrap();
            drop(conn);
        } else {
            conn.shutdown().await.unwrap();
            tokio::spawn(async move {
                let mut sink = Vec::new();
                let _ = conn.read_to_end(&mut sink).await;
            });
        }
        let busy = s
            .post("/v1/charges", "acct_a", Some(&k), body)
            .send()
            .await
            .unwrap();
        problem(busy, 409, "idempotency-key-in-progress").await;
        let done = s
            .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k), body))
            .await;
        assert_eq!(done.status(), 201, "reset: {reset}");
        assert_eq!(
            done.headers()["idempotent-replayed"],
            "true",
            "reset: {reset}"
        );
        assert_eq!(s.runs() - before, 1, "one execution (reset: {reset})");
    }
}
