//! Failures on the server's side: a store that fails or is full (503, the handler never runs),
//! store errors that never reach a problem body, completes that fail (retried, then the key is
//! held for the lease), misconfiguration (a missing middleware, unusable settings: refused or
//! 500, never a panic), and drain waiting for an execution whose client left.

use crate::{Fw, config, key, problem, serve, serve_wired};
use idempotent_core::http::{ConfigBuilder, ConfigError};
use idempotent_core::{Engine, MemoryStore, Store};
use idempotent_tests::faults::FaultyStore;
use std::time::Duration;

pub(crate) async fn failing_store_answers_503_and_never_runs_the_handler(fw: Fw) {
    // Every claim fails as a store that cannot be reached does.
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_next_claims(usize::MAX);
    let s = serve(fw, config(store.clone())).await;
    let charge = || s.post("/v1/charges", "acct_a", Some("k"), r#"{"amount": 1}"#);
    let res = charge().send().await.unwrap();
    assert_eq!(res.status(), 503, "with the store down");
    assert_eq!(res.headers()["retry-after"], "1");
    problem(res, 503, "idempotency-store-unavailable").await;
    assert_eq!(store.injected(), 1, "the claim reached the failing store");
    assert_eq!(s.runs(), 0, "the handler ran with the store down");
    // Once the store answers again, the key was never recorded: the retry runs, once.
    store.fail_next_claims(0);
    let res = charge().send().await.unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(res.headers()["idempotent-replayed"], "false");
    assert_eq!(s.runs(), 1);
}

/// A store at its total bound refuses new keys with 503 (no record, so a retry may run once
/// space frees); the handler does not run.
pub(crate) async fn a_full_store_answers_503_and_never_runs_the_handler(fw: Fw) {
    let s = serve(fw, config(MemoryStore::builder().max_entries(0).build())).await;
    let res = s
        .post("/v1/charges", "acct_a", Some("k"), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["retry-after"], "1");
    problem(res, 503, "idempotency-store-unavailable").await;
    assert_eq!(s.runs(), 0);
}

/// Database errors, table names and SQL go to the log, never into a problem body.
pub(crate) async fn problems_carry_no_internals(fw: Fw) {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_core::SqliteStore::connect(&format!(
        "sqlite://{}",
        dir.path().join("internals.db").display()
    ))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    sqlx::query("DROP TABLE idempotency_records")
        .execute(store.pool())
        .await
        .unwrap();
    let s = serve(fw, config(store)).await;
    let res = s
        .post("/v1/charges", "acct_a", Some("k"), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    let body = problem(res, 503, "idempotency-store-unavailable").await;
    let text = body.to_string().to_ascii_lowercase();
    for leak in [
        "idempotency_records",
        "no such table",
        "sqlite",
        "database",
        "select",
        "error returned",
    ] {
        assert!(!text.contains(leak), "`{leak}` leaked into {body}");
    }
    assert_eq!(s.runs(), 0);
}

pub(crate) async fn missing_middleware_is_a_clear_500(fw: Fw) {
    let s = serve_wired(fw, config(MemoryStore::new()), false).await;
    let res = s
        .client
        .post(format!("{}/v1/refunds", s.base))
        .header("authorization", "Bearer a")
        .header("idempotency-key", "k")
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    problem(res, 500, "idempotency-misconfigured").await;
}

/// Unusable settings are refused once, when the configuration is built; a route whose own
/// arguments do not fit the configured defaults answers 500 and never panics or runs.
pub(crate) async fn configuration_errors_never_panic(fw: Fw) {
    let build = |f: fn(ConfigBuilder) -> ConfigBuilder| {
        f(ConfigBuilder::new(Engine::new(MemoryStore::new())))
            .build()
            .err()
    };
    assert!(matches!(
        build(|b| b.ttl(Duration::MAX)),
        Some(ConfigError::TooLong { what: "ttl", .. })
    ));
    assert!(matches!(
        Engine::builder(MemoryStore::new())
            .lease(Duration::ZERO)
            .build()
            .err(),
        Some(ConfigError::TooShort { what: "lease", .. })
    ));
    assert!(matches!(
        build(|b| b.ttl(Duration::from_secs(5))),
        Some(ConfigError::TtlShorterThanLease { .. })
    ));
    let s = serve(
        fw,
        ConfigBuilder::new(
            Engine::builder(MemoryStore::new())
                .lease(Duration::from_secs(300))
                .build()
                .unwrap(),
        )
        .build()
        .unwrap(),
    )
    .await;
    for _ in 0..2 {
        let res = s
            .raw_post("/short-ttl", &key(), "text/plain", "")
            .send()
            .await
            .unwrap();
        problem(res, 500, "idempotency-misconfigured").await;
    }
    assert_eq!(s.runs(), 0);
}

/// A failed `complete` is retried within the lease; if it keeps failing, the record stays in
/// progress (a retry gets 409, not a second execution) until the lease ends.
pub(crate) async fn failed_completes_are_retried_then_hold_the_key(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, config(store.clone())).await;
    // Two transient failures: the retries store the response.
    store.fail_next_completes(2);
    let k = key();
    let first = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(store.injected(), 2);
    let replay = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(s.runs(), 1);

    // Every complete fails: the client still gets its response; a retry within the lease
    // (2 s on this route) gets 409; after the lease a retry takes over and runs again.
    store.fail_next_completes(usize::MAX);
    let k = key();
    let injected = store.injected();
    let first = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert!(
        store.injected() - injected >= 3,
        "bounded retries: {}",
        store.injected() - injected
    );
    let busy = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 2}"#)
        .send()
        .await
        .unwrap();
    problem(busy, 409, "idempotency-key-in-progress").await;
    assert_eq!(s.runs(), 2, "no second execution within the lease");
    store.fail_next_completes(0);
    let after = s
        .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 2}"#))
        .await;
    assert_eq!(after.status(), 201);
    assert_eq!(after.headers()["idempotent-replayed"], "false");
    assert_eq!(
        s.runs(),
        3,
        "after the lease: the documented limit of plain mode"
    );
}

/// Graceful shutdown: `drain` waits for an execution whose client left.
pub(crate) async fn drain_waits_for_executions_whose_client_left(fw: Fw) {
    let store = MemoryStore::new();
    let s = serve(fw, config(store.clone())).await;
    let k = key();
    let gone = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#)
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(gone.unwrap_err().is_timeout());
    assert_eq!(s.engine.running(), 1);
    let drained = s.engine.drain(Duration::from_secs(10)).await;
    assert_eq!(drained.still_running, 0);
    // Stored before drain returned; new work is refused while draining.
    let record = store
        .get(&idempotent_core::store::RecordKey::new(
            idempotent_core::Scope::new("acct_a").unwrap(),
            idempotent_core::IdempotencyKey::parse(k.as_bytes()).unwrap(),
        ))
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(
        record.state,
        idempotent_core::store::RecordState::Done { .. }
    ));
    let res = s
        .post("/v1/charges", "acct_a", Some(&key()), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    problem(res, 503, "idempotency-shutting-down").await;
    assert_eq!(s.runs(), 1);
}
