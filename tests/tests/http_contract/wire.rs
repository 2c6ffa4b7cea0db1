//! The wire contract, run once per store (memory, SQLite, PostgreSQL, MySQL, Redis standalone
//! and cluster): first execution and replay, mismatches, missing and malformed keys, extractor
//! rejections before the claim, releases on 5xx and panics, concurrent duplicates, path
//! parameters and query strings, form bodies, and (from the other modules) a client that times
//! out and streamed responses; and hop-by-hop headers that a replay never carries.

use crate::clients::client_timeout_then_retry;
use crate::streams::streamed_responses;
use crate::transactional::refuses_the_wrong_database;
use crate::{Fw, Server, config, key, problem, serve};
use idempotent_core::MemoryStore;
use idempotent_core::http::Config;

async fn contract(fw: Fw, config: Config) {
    let s = serve(fw, config).await;
    let key = key();

    // First request: runs once, stored, marked not replayed.
    let first = s
        .post("/v1/charges", "acct_a", Some(&key), r#"{"amount": 100}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    let first_body = first.bytes().await.unwrap();
    assert_eq!(s.runs(), 1);

    // Retry (keys reordered, spaced; quoted sf-string key): the stored response, replayed.
    let quoted = format!("\"{key}\"");
    let retry = s
        .post(
            "/v1/charges",
            "acct_a",
            Some(&quoted),
            "{ \"amount\" : 100 }",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let traces: Vec<_> = retry
        .headers()
        .get_all("x-trace")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    assert_eq!(traces, ["a1", "b1"], "repeated headers kept in order");
    assert_eq!(retry.headers()["content-type"], "application/json");
    assert_eq!(retry.bytes().await.unwrap(), first_body, "same body bytes");
    assert_eq!(s.runs(), 1, "the handler did not run again");

    // Same key, different body: 422; same key on another route: 422.
    let other = s
        .post("/v1/charges", "acct_a", Some(&key), r#"{"amount": 101}"#)
        .send()
        .await
        .unwrap();
    problem(other, 422, "idempotency-key-mismatch").await;
    let route = s
        .post("/v1/refunds", "acct_a", Some(&key), r#"{"amount": 100}"#)
        .send()
        .await
        .unwrap();
    problem(route, 422, "idempotency-key-mismatch").await;

    // Same key, another account: its own execution.
    let b = s
        .post("/v1/charges", "acct_b", Some(&key), r#"{"amount": 100}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(b.status(), 201);
    assert_eq!(b.headers()["idempotent-replayed"], "false");
    assert_eq!(s.runs(), 2);

    // Missing and malformed keys: 400, nothing runs.
    problem(
        s.post("/v1/charges", "acct_a", None, r#"{"amount": 1}"#)
            .send()
            .await
            .unwrap(),
        400,
        "idempotency-key-missing",
    )
    .await;
    let long = "x".repeat(256);
    for bad in ["", "\"unterminated", long.as_str(), "has space"] {
        let res = s
            .post("/v1/charges", "acct_a", Some(bad), r#"{"amount": 1}"#)
            .send()
            .await
            .unwrap();
        problem(res, 400, "idempotency-key-invalid").await;
    }
    let two = s
        .post("/v1/charges", "acct_a", Some("one"), r#"{"amount": 1}"#)
        .header("idempotency-key", "two")
        .send()
        .await
        .unwrap();
    problem(two, 400, "idempotency-key-invalid").await;
    let nonascii = s
        .post("/v1/charges", "acct_a", None, r#"{"amount": 1}"#)
        .header(
            "idempotency-key",
            reqwest::header::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        )
        .send()
        .await
        .unwrap();
    problem(nonascii, 400, "idempotency-key-invalid").await;
    assert_eq!(s.runs(), 2);

    // Safe methods ignore the key, even a malformed one.
    let list = s
        .client
        .get(format!("{}/v1/charges", s.base))
        .header("idempotency-key", "\"not closed")
        .send()
        .await
        .unwrap();
    assert_eq!(list.status(), 200);
    assert_eq!(list.text().await.unwrap(), "runs=2");

    // Extractor rejections happen before the claim: a corrected retry with the same key runs.
    let k2 = self::key();
    let bad_json = s
        .post("/v1/charges", "acct_a", Some(&k2), r#"{"amount": "#)
        .send()
        .await
        .unwrap();
    assert!(bad_json.status().is_client_error());
    let no_auth = s
        .post("/v1/charges", "", Some(&k2), r#"{"amount": 5}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(no_auth.status(), 401);
    let fixed = s
        .post("/v1/charges", "acct_a", Some(&k2), r#"{"amount": 5}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(fixed.status(), 201);
    assert_eq!(s.runs(), 3);

    // A 5xx releases the key: the retry runs again.
    let k3 = self::key();
    for _ in 0..2 {
        let res = s
            .post("/v1/charges", "acct_a", Some(&k3), r#"{"amount": 500}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 502);
    }
    assert_eq!(s.runs(), 5);

    // A panicking handler releases the key: the retry runs (and succeeds this time).
    let k4 = self::key();
    let boom = s
        .post("/v1/charges", "acct_a", Some(&k4), r#"{"amount": 13}"#)
        .send()
        .await;
    assert!(boom.is_err() || boom.unwrap().status().is_server_error());
    let after = s
        .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k4), r#"{"amount": 13}"#))
        .await;
    assert_eq!(after.status(), 201);
    assert_eq!(after.headers()["idempotent-replayed"], "false");
    assert_eq!(s.runs(), 7);

    // 32 concurrent identical requests against a slow handler: one execution; the others
    // get 409 with Retry-After, or the replay.
    let k5 = self::key();
    let before = s.runs();
    let requests: Vec<_> = (0..32)
        .map(|_| {
            s.post("/v1/charges", "acct_a", Some(&k5), r#"{"amount": 7}"#)
                .send()
        })
        .collect();
    let responses = futures_util::future::join_all(requests).await;
    let (mut created, mut busy) = (0, 0);
    for res in responses {
        let res = res.unwrap();
        match res.status().as_u16() {
            201 => created += 1,
            409 => {
                assert!(
                    res.headers()["retry-after"]
                        .to_str()
                        .unwrap()
                        .parse::<u64>()
                        .unwrap()
                        >= 1
                );
                problem(res, 409, "idempotency-key-in-progress").await;
                busy += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(created + busy, 32);
    assert!(created >= 1);
    assert_eq!(s.runs() - before, 1, "exactly one execution");

    client_timeout_then_retry(&s).await;
    path_parameters_are_part_of_the_request(&s).await;
    form_bodies(&s).await;
    streamed_responses(&s).await;
}

async fn path_parameters_are_part_of_the_request(s: &Server) {
    let k = key();
    let before = s.runs();
    let one = s
        .post("/orders/1/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    assert_eq!(one.status(), 201);
    let one_body = one.text().await.unwrap();
    assert!(one_body.contains("of order 1"), "{one_body}");
    // Another order under the same key: a different operation, never order 1's replay.
    let two = s
        .post("/orders/2/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    problem(two, 422, "idempotency-key-mismatch").await;
    // The same path as received, percent-encoded or under a nested router's prefix, is
    // another request too (no normalisation).
    let encoded = s
        .post("/orders/%31/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    problem(encoded, 422, "idempotency-key-mismatch").await;
    let nested = s
        .post("/v2/orders/1/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    problem(nested, 422, "idempotency-key-mismatch").await;
    // The same path replays; a query string is part of the request.
    let again = s
        .post("/orders/1/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), one_body);
    let query = s
        .post("/orders/1/refund?reason=dup", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    problem(query, 422, "idempotency-key-mismatch").await;
    // Nested routes keep their prefix in the fingerprint and still replay.
    let k2 = key();
    let first = s
        .post("/v2/orders/9/refund", "acct_a", Some(&k2), "")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    let replay = s
        .post("/v2/orders/9/refund", "acct_a", Some(&k2), "")
        .send()
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(s.runs() - before, 2);
}

async fn form_bodies(s: &Server) {
    let form = "application/x-www-form-urlencoded";
    let before = s.runs();
    let k = key();
    let first = s
        .raw_post("/echo", &k, form, "amount=1&amount=100&currency=usd")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    // Field order does not matter ...
    let moved = s
        .raw_post("/echo", &k, form, "currency=usd&amount=1&amount=100")
        .send()
        .await
        .unwrap();
    assert_eq!(moved.headers()["idempotent-replayed"], "true");
    // ... the order of a repeated field's values does.
    let swapped = s
        .raw_post("/echo", &k, form, "amount=100&amount=1&currency=usd")
        .send()
        .await
        .unwrap();
    problem(swapped, 422, "idempotency-key-mismatch").await;
    assert_eq!(s.runs() - before, 1);
}

pub(crate) async fn contract_on_memory_store(fw: Fw) {
    contract(fw, config(MemoryStore::new())).await;
}

pub(crate) async fn contract_on_sqlite_store(fw: Fw) {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_core::SqliteStore::connect(&format!(
        "sqlite://{}",
        dir.path().join("e2e.db").display()
    ))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    contract(fw, config(store)).await;
}

pub(crate) async fn contract_on_postgres_store(fw: Fw) {
    let pool = idempotent_tests::fixtures::pg_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("e2e");
    let store = idempotent_tests::fixtures::pg_store(pool.clone(), &table).await;
    contract(fw, config(store)).await;
    idempotent_tests::fixtures::pg_drop(&pool, &table).await;
}

pub(crate) async fn contract_on_mysql_store(fw: Fw) {
    let pool = idempotent_tests::fixtures::mysql_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("e2e");
    let store = idempotent_tests::fixtures::mysql_store(pool.clone(), &table).await;
    contract(fw, config(store)).await;
    idempotent_tests::fixtures::mysql_drop(&pool, &table).await;
}

/// The contract on Redis; its transactional routes refuse (no transaction spans Redis and a
/// SQL database), and the automatic sweeper never starts (Redis expires records itself).
async fn contract_on_redis(fw: Fw, fixture: idempotent_tests::fixtures::Redis) {
    let config = config(fixture.store().await);
    let engine = config.engine().clone();
    contract(fw, config).await;
    assert!(
        !engine.sweeper_running(),
        "the sweeper started on a store that expires records itself"
    );
    let s = serve(fw, self::config(fixture.store().await)).await;
    refuses_the_wrong_database(&s, "/tx/postgres", "PostgreSQL").await;
    refuses_the_wrong_database(&s, "/tx/sqlite", "SQLite").await;
    refuses_the_wrong_database(&s, "/tx/mysql", "MySQL").await;
    idempotent_tests::Fixture::cleanup(&fixture).await;
}

pub(crate) async fn contract_on_redis_standalone(fw: Fw) {
    contract_on_redis(fw, idempotent_tests::fixtures::Redis::standalone()).await;
}

pub(crate) async fn contract_on_redis_cluster(fw: Fw) {
    contract_on_redis(fw, idempotent_tests::fixtures::Redis::cluster()).await;
}

/// Headers a response names in its `Connection` header are hop-by-hop (RFC 9110 §7.6.1), as
/// `Connection` itself is: never stored, so a replay carries none of them, while its
/// end-to-end headers are replayed.
pub(crate) async fn headers_named_in_connection_are_never_replayed(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    let key = key();
    let first = s.post("/hop", "", Some(&key), "{}").send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    let replay = s.post("/hop", "", Some(&key), "{}").send().await.unwrap();
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["x-end"], "3", "{:?}", replay.headers());
    for hop in ["connection", "x-hop", "x-other"] {
        assert!(
            replay.headers().get(hop).is_none(),
            "{hop} was replayed: {:?}",
            replay.headers()
        );
    }
    assert_eq!(replay.text().await.unwrap(), "hop");
    assert_eq!(s.runs(), 1);
}
