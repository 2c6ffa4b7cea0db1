//! The charges example as a real process on a free port, driven over HTTP: every case against
//! both binaries (`charges-axum`, `charges-actix`), on memory, SQLite, PostgreSQL and MySQL
//! (MariaDB: `MYSQL_URL`, each test on a database of its own). The two serve one contract, so
//! every assertion holds for both.
#![allow(clippy::unwrap_used)] // tests unwrap freely

mod common;

use common::{Bin, MySqlDb, Server, start, start_reading, until_working};
use idempotent_examples::provider::Provider;
use serde_json::Value;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Whether a duplicate meets the first attempt's open transaction and waits for its commit
/// (then gets the replay) instead of a 409: transactional mode's single commit on SQLite,
/// whose one write lock the first attempt holds.
fn duplicates_wait(database: &str) -> bool {
    database.starts_with("sqlite:")
}

/// SIGKILL while the handler sleeps inside its transaction (the server prints `working`
/// there), then a new process and the retry: the charge row rolled back with the claim (single
/// commit) or stayed unwritten under an expiring claim (two commits), so the retry runs once.
/// Business rows equal logical operations: none duplicated, none lost. Trials alternate the
/// commit paths; `CRASH_TRIALS` sets how many (default 10 per binary, 20 per database).
///
/// The handler was killed *after* it paid at the fake provider, whose payments survive the
/// crash (outside the transaction): the re-run pays again under the key derived from the
/// request's (`idem.derive`), with the derive secret the database keeps across restarts, so
/// the provider returns the same payment and holds exactly one per operation.
async fn crash_inside_the_transaction(bin: Bin, database: &str) {
    let trials: usize = std::env::var("CRASH_TRIALS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(10);
    let acct = account();
    for i in 0..trials {
        let commit = if i % 2 == 0 { "single" } else { "two" };
        let common = ["--lease", "1s", "--commit", commit];
        let (mut doomed, out) = start_reading(
            bin,
            database,
            &[&common[..], &["--work-delay", "30s", "--announce-work"]].concat(),
        );
        let k = key();
        let pending = tokio::spawn(Api::new(&doomed).json(&acct, &k, CHARGE).send());
        until_working(out).await;
        doomed.child.kill().unwrap();
        doomed.child.wait().unwrap();
        assert!(pending.await.unwrap().is_err(), "the client saw the crash");
        let fresh = start(bin, database, &common);
        let api = Api::new(&fresh);
        let res = api.until_not_busy(|| api.json(&acct, &k, CHARGE)).await;
        assert_eq!(res.status(), 201, "trial {i} ({commit})");
        assert_eq!(res.headers()["idempotent-replayed"], "false");
        let body = res.bytes().await.unwrap();
        let again = api.json(&acct, &k, CHARGE).send().await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.bytes().await.unwrap(), body);
        assert_eq!(api.count(&acct).await, i + 1, "trial {i} ({commit})");
        let payment: Value = serde_json::from_slice(&body).unwrap();
        assert!(payment["payment"].as_str().unwrap().starts_with("py_"));
        assert_eq!(
            payments(database, &acct).await,
            i + 1,
            "trial {i} ({commit}): the provider was paid twice"
        );
    }
}

/// `--wait`: a duplicate sent to a second instance waits for the first attempt; the first
/// attempt's process is then killed (SIGKILL, mid-handler). The waiter never hangs: its wait
/// ends at its deadline (409) or, when the dead attempt's lease ends first, it takes the record
/// over and makes the charge itself; either way the account ends with one charge.
async fn waiters_outlive_a_killed_first_attempt(bin: Bin, database: &str) {
    let common = ["--lease", "2s", "--commit", "two", "--wait", "2s"];
    let (mut doomed, out) = start_reading(
        bin,
        database,
        &[&common[..], &["--work-delay", "30s", "--announce-work"]].concat(),
    );
    let other = start(bin, database, &common);
    let (acct, k) = (account(), key());
    let pending = tokio::spawn(Api::new(&doomed).json(&acct, &k, CHARGE).send());
    until_working(out).await;
    let api = Api::new(&other);
    let waiter = tokio::spawn(api.json(&acct, &k, CHARGE).send());
    tokio::time::sleep(Duration::from_millis(200)).await;
    doomed.child.kill().unwrap();
    doomed.child.wait().unwrap();
    assert!(pending.await.unwrap().is_err(), "the client saw the crash");
    let answered = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter hung past its wait and the lease")
        .unwrap()
        .unwrap();
    match answered.status().as_u16() {
        409 => {}
        201 => assert_eq!(answered.headers()["idempotent-replayed"], "false"),
        other => panic!("the waiter got {other}"),
    }
    let res = api.until_not_busy(|| api.json(&acct, &k, CHARGE)).await;
    assert_eq!(res.status(), 201);
    assert_eq!(api.count(&acct).await, 1);
}

async fn killed_first_attempt_on_sqlite(bin: Bin) {
    let (_dir, url) = temp_sqlite();
    waiters_outlive_a_killed_first_attempt(bin, &url).await;
}

async fn killed_first_attempt_on_postgres(bin: Bin) {
    waiters_outlive_a_killed_first_attempt(bin, &std::env::var("DATABASE_URL").unwrap()).await;
}

/// The fake provider's payments for `account` (its ledger survives the server).
async fn payments(database: &str, account: &str) -> usize {
    let provider = Provider::open(database).await.unwrap();
    provider.payments(account).await.unwrap()
}

/// `charges-client` through its lossy proxy (30% of attempts lost, half of them after the
/// server answered): every one of its 100 charges is made exactly once, at the API and at the
/// provider, and the proxy did lose requests and responses.
async fn lossy_client(bin: Bin, database: &str) {
    let server = start(bin, database, &[]);
    let acct = account();
    let out = Command::new(env!("CARGO_BIN_EXE_charges-client"))
        .args([
            "--url",
            &server.base,
            "--count",
            "100",
            "--fail-rate",
            "0.3",
        ])
        .args(["--seed", "12", "--account", &acct])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = text.lines().last().unwrap();
    assert_eq!(last, format!("charges on {acct}: 100"), "{text}");
    let dropped = text
        .lines()
        .find_map(|l| l.strip_prefix("dropped "))
        .unwrap();
    let numbers: Vec<usize> = dropped.split(' ').filter_map(|w| w.parse().ok()).collect();
    assert!(
        numbers.len() == 2 && numbers.iter().all(|n| *n > 0),
        "{text}"
    );
    assert_eq!(Api::new(&server).count(&acct).await, 100);
    assert_eq!(payments(database, &acct).await, 100);
}

async fn lossy_client_on_sqlite(bin: Bin) {
    let (_dir, url) = temp_sqlite();
    lossy_client(bin, &url).await;
}

async fn lossy_client_on_postgres(bin: Bin) {
    lossy_client(bin, &std::env::var("DATABASE_URL").unwrap()).await;
}

async fn lossy_client_on_mysql(bin: Bin) {
    let db = MySqlDb::create().await;
    lossy_client(bin, &db.url).await;
}

/// A SQLite database URL in a new temporary directory (removed when the guard drops).
fn temp_sqlite() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("charges.db").display());
    (dir, url)
}

fn account() -> String {
    format!("acct_{}", uuid::Uuid::new_v4().simple())
}

fn key() -> String {
    uuid::Uuid::new_v4().to_string()
}

struct Api {
    client: reqwest::Client,
    base: String,
}

impl Api {
    fn new(s: &Server) -> Self {
        Api {
            client: reqwest::Client::new(),
            base: s.base.clone(),
        }
    }
    fn json(&self, account: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}/v1/charges", self.base))
            .bearer_auth(account)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
    }
    fn form(&self, account: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}/v1/charges", self.base))
            .bearer_auth(account)
            .header("idempotency-key", key)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.to_owned())
    }
    fn refund(&self, account: &str, key: &str, charge: &str) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}/v1/charges/{charge}/refunds", self.base))
            .bearer_auth(account)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(r#"{"amount": 100}"#)
    }
    async fn refunds(&self, account: &str, charge: &str) -> usize {
        let list: Value = self
            .client
            .get(format!("{}/v1/charges/{charge}/refunds", self.base))
            .bearer_auth(account)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        list["data"].as_array().unwrap().len()
    }
    /// Retries while the answer is 409, as a client honouring `Retry-After` would (faster).
    async fn until_not_busy(&self, req: impl Fn() -> reqwest::RequestBuilder) -> reqwest::Response {
        for _ in 0..100 {
            let res = req().send().await.unwrap();
            if res.status() != 409 {
                return res;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("still in progress after 10 s");
    }
    async fn count(&self, account: &str) -> usize {
        let list: Value = self
            .client
            .get(format!("{}/v1/charges", self.base))
            .bearer_auth(account)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(list["object"], "list");
        list["data"].as_array().unwrap().len()
    }
}

const CHARGE: &str = r#"{"amount": 500, "currency": "usd", "customer": "cus_123"}"#;

async fn contract(bin: Bin, database: &str) {
    let server = start(bin, database, &[]);
    let api = Api::new(&server);
    let acct = account();

    assert_eq!(
        api.client
            .get(format!("{}/healthz", api.base))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    // The framework's own answers agree too: other methods 405, HEAD where GET is, and a
    // large (300 KB) valid charge within both binaries' default body limit.
    let put = api
        .client
        .put(format!("{}/v1/charges", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 405);
    let head = api
        .client
        .head(format!("{}/healthz", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    let big = format!(
        r#"{{"amount": 5, "currency": "usd", "customer": "{}"}}"#,
        "c".repeat(300_000)
    );
    let large = api.json(&account(), &key(), &big).send().await.unwrap();
    assert_eq!(large.status(), 201);

    // First charge, then its replay: same bytes, replay header; one charge written.
    let k = key();
    let first = api.json(&acct, &k, CHARGE).send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    let body = first.bytes().await.unwrap();
    let charge: Value = serde_json::from_slice(&body).unwrap();
    assert!(charge["id"].as_str().unwrap().starts_with("ch_"));
    assert_eq!(
        (charge["object"].as_str(), charge["account"].as_str()),
        (Some("charge"), Some(acct.as_str()))
    );
    assert_eq!(
        (
            charge["amount"].as_i64(),
            charge["currency"].as_str(),
            charge["customer"].as_str()
        ),
        (Some(500), Some("usd"), Some("cus_123"))
    );
    assert!(charge["created"].as_i64().unwrap() > 1_700_000_000);
    let replay = api
        .json(
            &acct,
            &k,
            r#"{"customer":"cus_123","currency":"usd","amount":500}"#,
        )
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.bytes().await.unwrap(), body);
    assert_eq!(api.count(&acct).await, 1);

    // Same key, different charge: 422.
    let other = api
        .json(
            &acct,
            &k,
            r#"{"amount": 501, "currency": "usd", "customer": "cus_123"}"#,
        )
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 422);
    assert_eq!(other.headers()["content-type"], "application/problem+json");

    // 401 without (or with an empty) bearer.
    let anon = api
        .client
        .post(format!("{}/v1/charges", api.base))
        .header("idempotency-key", key())
        .header("content-type", "application/json")
        .body(CHARGE)
        .send()
        .await
        .unwrap();
    assert_eq!(anon.status(), 401);
    let empty = api.json("", &key(), CHARGE).send().await.unwrap();
    assert_eq!(empty.status(), 401);

    // 400 before any claim: the corrected retry with the same key succeeds.
    let k2 = key();
    for bad in [
        r#"{"amount": 0, "currency": "usd", "customer": "cus_1"}"#,
        r#"{"amount": 5, "currency": "dollars", "customer": "cus_1"}"#,
        r#"{"amount": 5, "currency": "usd"}"#,
        r#"{"amount": 5, "#,
    ] {
        let res = api.json(&acct, &k2, bad).send().await.unwrap();
        assert_eq!(res.status(), 400, "{bad}");
        assert_eq!(res.headers()["content-type"], "application/problem+json");
    }
    let fixed = api.json(&acct, &k2, CHARGE).send().await.unwrap();
    assert_eq!(fixed.status(), 201);
    assert_eq!(fixed.headers()["idempotent-replayed"], "false");
    assert_eq!(api.count(&acct).await, 2);

    // Form bodies: pairs reordered replay; a JSON body under that key is a 422.
    let k3 = key();
    let f1 = api
        .form(&acct, &k3, "amount=700&currency=eur&customer=cus_9")
        .send()
        .await
        .unwrap();
    assert_eq!(f1.status(), 201);
    let f1_body = f1.bytes().await.unwrap();
    let f2 = api
        .form(&acct, &k3, "customer=cus_9&amount=700&currency=eur")
        .send()
        .await
        .unwrap();
    assert_eq!(f2.headers()["idempotent-replayed"], "true");
    assert_eq!(f2.bytes().await.unwrap(), f1_body);
    let as_json = api
        .json(
            &acct,
            &k3,
            r#"{"amount": 700, "currency": "eur", "customer": "cus_9"}"#,
        )
        .send()
        .await
        .unwrap();
    assert_eq!(as_json.status(), 422);
    assert_eq!(api.count(&acct).await, 3);

    // 8 concurrent duplicates of 100 operations: exactly 100 charges.
    let racer = account();
    let mut requests = Vec::new();
    for op in 0..100 {
        let k = key();
        let body = format!(
            r#"{{"amount": {}, "currency": "usd", "customer": "cus_{op}"}}"#,
            op + 1
        );
        for _ in 0..8 {
            requests.push(api.json(&racer, &k, &body).send());
        }
    }
    let mut created = 0;
    for res in futures_util::future::join_all(requests).await {
        let status = res.unwrap().status().as_u16();
        assert!(matches!(status, 201 | 409), "{status}");
        created += usize::from(status == 201);
    }
    assert!(created >= 100);
    assert_eq!(api.count(&racer).await, 100);

    // The charge in the path is part of the request: one key for two charges' refunds is a
    // 422 for the second, never a replay of the first.
    let a: Value = api
        .json(&acct, &key(), CHARGE)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let b: Value = api
        .json(&acct, &key(), CHARGE)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let (a, b) = (a["id"].as_str().unwrap(), b["id"].as_str().unwrap());
    let k5 = key();
    let refund = api.refund(&acct, &k5, a).send().await.unwrap();
    assert_eq!(refund.status(), 201);
    let refund_body = refund.bytes().await.unwrap();
    let other = api.refund(&acct, &k5, b).send().await.unwrap();
    assert_eq!(other.status(), 422);
    assert_eq!(other.headers()["content-type"], "application/problem+json");
    let again = api.refund(&acct, &k5, a).send().await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.bytes().await.unwrap(), refund_body);
    assert_eq!(
        (api.refunds(&acct, a).await, api.refunds(&acct, b).await),
        (1, 0)
    );
    drop(server);

    // 409 while the first attempt is still with the "payment provider".
    let slow = start(bin, database, &["--work-delay", "2s"]);
    let api = Api::new(&slow);
    let k4 = key();
    let first = tokio::spawn(api.json(&acct, &k4, CHARGE).send());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let busy = api.json(&acct, &k4, CHARGE).send().await.unwrap();
    if duplicates_wait(database) {
        assert_eq!(busy.status(), 201);
        assert_eq!(busy.headers()["idempotent-replayed"], "true");
    } else {
        assert_eq!(busy.status(), 409);
        assert!(
            busy.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
                >= 1
        );
    }
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), 201);
    let after = api.json(&acct, &k4, CHARGE).send().await.unwrap();
    assert_eq!(after.headers()["idempotent-replayed"], "true");

    // The client times out while the provider is slow, then retries: 409 while the first
    // attempt runs, then its stored response. Exactly one charge.
    let timer = account();
    let k6 = key();
    let gone = api
        .json(&timer, &k6, CHARGE)
        .timeout(Duration::from_millis(500))
        .send()
        .await
        .expect_err("the client gave up");
    assert!(gone.is_timeout(), "the timeout fired: {gone}");
    let busy = api.json(&timer, &k6, CHARGE).send().await.unwrap();
    if duplicates_wait(database) {
        assert_eq!(busy.headers()["idempotent-replayed"], "true");
    } else {
        assert_eq!(busy.status(), 409);
        assert!(busy.headers().contains_key("retry-after"));
    }
    let done = api.until_not_busy(|| api.json(&timer, &k6, CHARGE)).await;
    assert_eq!(done.status(), 201);
    assert_eq!(done.headers()["idempotent-replayed"], "true");
    assert_eq!(api.count(&timer).await, 1, "exactly one charge");
}

/// SIGTERM while charges whose clients left are still with the provider (one client timed out,
/// another reset its connection): the server drains (finishes and stores them) before
/// exiting, and retries against a restarted server get the stored responses. Exactly one
/// charge per key.
async fn drains_on_shutdown(bin: Bin, database: &str) {
    use tokio::io::AsyncWriteExt;
    let acct = account();
    let (k, k2) = (key(), key());
    let mut slow = start(bin, database, &["--work-delay", "2s"]);
    let api = Api::new(&slow);
    // A client that resets its connection (RST) while the charge runs.
    let addr = slow.base.trim_start_matches("http://").to_owned();
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let request = format!(
        "POST /v1/charges HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {acct}\r\nidempotency-key: {k2}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{CHARGE}",
        CHARGE.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    // A client that times out.
    let gone = api
        .json(&acct, &k, CHARGE)
        .timeout(Duration::from_millis(300))
        .send()
        .await
        .expect_err("the client gave up");
    assert!(gone.is_timeout(), "{gone}");
    // A zero linger makes the close a reset; nothing blocks on it.
    #[allow(deprecated)]
    conn.set_linger(Some(Duration::ZERO)).unwrap();
    drop(conn);
    let killed = Command::new("kill")
        .args(["-TERM", &slow.child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let exit = tokio::task::spawn_blocking(move || slow.child.wait().unwrap())
        .await
        .unwrap();
    assert!(exit.success(), "clean exit after draining: {exit:?}");
    let again = start(bin, database, &[]);
    let api = Api::new(&again);
    for k in [&k, &k2] {
        let replay = api.json(&acct, k, CHARGE).send().await.unwrap();
        assert_eq!(replay.status(), 201);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
    }
    assert_eq!(api.count(&acct).await, 2);
}

async fn charges_on_sqlite(bin: Bin) {
    let (_dir, url) = temp_sqlite();
    contract(bin, &url).await;
    drains_on_shutdown(bin, &url).await;
}

async fn charges_on_postgres(bin: Bin) {
    let url = std::env::var("DATABASE_URL").unwrap();
    contract(bin, &url).await;
    drains_on_shutdown(bin, &url).await;
}

async fn crash_on_sqlite(bin: Bin) {
    let (_dir, url) = temp_sqlite();
    crash_inside_the_transaction(bin, &url).await;
}

async fn crash_on_postgres(bin: Bin) {
    crash_inside_the_transaction(bin, &std::env::var("DATABASE_URL").unwrap()).await;
}

async fn charges_on_mysql(bin: Bin) {
    let db = MySqlDb::create().await;
    contract(bin, &db.url).await;
    drains_on_shutdown(bin, &db.url).await;
}

async fn crash_on_mysql(bin: Bin) {
    let db = MySqlDb::create().await;
    crash_inside_the_transaction(bin, &db.url).await;
}

async fn charges_on_memory(bin: Bin) {
    contract(bin, "memory").await;
}

/// `--metrics`: `GET /metrics` serves the idempotency metrics in Prometheus' text format, and
/// the scrape counts each outcome the test caused; without the flag there is no such route.
async fn metrics_are_scraped(bin: Bin) {
    let (_dir, url) = temp_sqlite();
    let s = start(bin, &url, &["--metrics"]);
    let api = Api::new(&s);
    let acct = account();
    let k = key();
    assert_eq!(
        api.json(&acct, &k, CHARGE).send().await.unwrap().status(),
        201
    );
    assert_eq!(
        api.json(&acct, &k, CHARGE).send().await.unwrap().status(),
        201
    );
    let other = r#"{"amount": 1, "currency": "usd", "customer": "cus_1"}"#;
    assert_eq!(
        api.json(&acct, &k, other).send().await.unwrap().status(),
        422
    );
    let no_key = api
        .client
        .post(format!("{}/v1/charges", api.base))
        .bearer_auth(&acct)
        .header("content-type", "application/json")
        .body(CHARGE)
        .send()
        .await
        .unwrap();
    assert_eq!(no_key.status(), 400);
    let scrape = api
        .client
        .get(format!("{}/metrics", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(scrape.status(), 200);
    let text = scrape.text().await.unwrap();
    for line in [
        r#"idempotent_requests_total{route="create_charge_sqlite",outcome="executed"} 1"#,
        r#"idempotent_requests_total{route="create_charge_sqlite",outcome="replayed"} 1"#,
        r#"idempotent_requests_total{route="create_charge_sqlite",outcome="mismatch"} 1"#,
        r#"idempotent_requests_total{route="/v1/charges",outcome="rejected"} 1"#,
        "idempotent_in_flight 0",
    ] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
    }
    // The transactional path times its begin and its commit.
    for operation in ["begin", "commit"] {
        let count =
            format!(r#"idempotent_store_duration_seconds_count{{operation="{operation}"}}"#);
        assert!(text.contains(&count), "no `{count}` in:\n{text}");
    }
    drop(s);
    let plain = start(bin, &url, &[]);
    let res = reqwest::get(format!("{}/metrics", plain.base))
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
}

/// Runs the binary with `args`, expecting it to refuse to start: its stderr. A binary that
/// starts instead is killed and fails the test (rather than hanging it).
/// [`refused`] for `bin` on a free port and the memory store, with `args` after those.
fn refused_on_memory(bin: Bin, args: &[&str]) -> String {
    let mut all = vec!["--listen", "127.0.0.1:0", "--database", "memory"];
    all.extend_from_slice(args);
    refused(bin, &all)
}

fn refused(bin: Bin, args: &[&str]) -> String {
    let mut child = Command::new(bin.path())
        .args(args)
        .env_remove("IDEMPOTENCY_SECRET")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("started with {args:?}, which it should have refused");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "{args:?}");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    err
}

async fn bad_flags_fail_clearly(bin: Bin) {
    assert!(refused(bin, &["--lease", "0s"]).contains("is zero"));
    // Plain mode has no commit path.
    let err = refused(bin, &["--plain", "--commit", "two"]);
    assert!(err.contains("cannot be used with"), "{err}");
    let err = refused(
        bin,
        &["--listen", "127.0.0.1:0", "--database", "oracle://nope"],
    );
    assert!(err.contains("unsupported database URL"), "{err}");
    assert!(
        err.contains("mysql://"),
        "the supported URLs are listed: {err}"
    );
    // A derive secret other than the one the database's instances use is refused at start-up
    // (a retry served under it would pay the provider again); a short one too.
    let (_dir, url) = temp_sqlite();
    drop(start(bin, &url, &[]));
    for (secret, says) in [
        (
            "another secret of at least thirty-two bytes",
            "derive secret differs",
        ),
        ("short", "invalid derive secret"),
    ] {
        let err = refused(
            bin,
            &[
                "--listen",
                "127.0.0.1:0",
                "--database",
                &url,
                "--derive-secret",
                secret,
            ],
        );
        assert!(err.contains(says), "{err}");
    }
    // The same database, no flag: the kept secret, so it starts.
    drop(start(bin, &url, &[]));
    // A lease longer than the default ttl is refused at start-up, not per request.
    let err = refused_on_memory(bin, &["--lease", "2d"]);
    assert!(err.contains("invalid configuration"), "{err}");
    // A wait longer than the lease too.
    let err = refused_on_memory(bin, &["--lease", "1s", "--wait", "2s"]);
    assert!(err.contains("longer than `lease`"), "{err}");
}

/// A key reused once its record is gone (expired and swept; here deleted) reaches the
/// provider with the same derived key: for the same charge the provider gives the first
/// payment back, for another charge it refuses, and the API answers 422, stored.
async fn key_reused_after_its_record_is_gone(bin: Bin) {
    let (_dir, url) = temp_sqlite();
    let server = start(bin, &url, &[]);
    let api = Api::new(&server);
    let (acct, k) = (account(), key());
    let first: Value = api
        .json(&acct, &k, CHARGE)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let forget = || async {
        let gone = sqlx::query("DELETE FROM idempotency_records WHERE key = ?1")
            .bind(&k)
            .execute(&pool)
            .await
            .unwrap();
        assert_eq!(gone.rows_affected(), 1);
    };
    forget().await;
    let same: Value = api
        .json(&acct, &k, CHARGE)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(same["payment"], first["payment"], "{same}");
    assert_ne!(same["id"], first["id"]);
    forget().await;
    let other = r#"{"amount": 501, "currency": "usd", "customer": "cus_123"}"#;
    let res = api.json(&acct, &k, other).send().await.unwrap();
    assert_eq!(res.status(), 422);
    let body: Value = res.json().await.unwrap();
    assert!(
        body["type"]
            .as_str()
            .unwrap()
            .ends_with("/payment-key-reused"),
        "{body}"
    );
    assert_eq!(payments(&url, &acct).await, 1);
}

/// A database failure inside the handler is a 500 problem that says nothing of the database:
/// the error text goes to the server's log.
async fn handler_errors_carry_no_database_text(bin: Bin) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.db");
    let url = format!("sqlite://{}", path.display());
    let server = start(bin, &url, &[]);
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("DROP TABLE charges")
        .execute(&pool)
        .await
        .unwrap();
    let api = Api::new(&server);
    let res = api.json(&account(), &key(), CHARGE).send().await.unwrap();
    assert_eq!(res.status(), 500);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let body = res.text().await.unwrap().to_ascii_lowercase();
    for leak in ["no such table", "sqlite", "error returned", "insert into"] {
        assert!(!body.contains(leak), "`{leak}` leaked: {body}");
    }
}

/// Stamps out each case for both binaries: `axum::name` and `actix::name`.
/// Runs one case against both binaries side by side, each on a thread and a runtime of its
/// own ([`side_by_side`](idempotent_tests::side_by_side::side_by_side)), naming the binary
/// that failed.
fn on_both_binaries<F>(case: fn(Bin) -> F)
where
    F: Future<Output = ()> + 'static,
{
    idempotent_tests::side_by_side::side_by_side(
        [("charges-axum", Bin::Axum), ("charges-actix", Bin::Actix)],
        case,
    );
}

/// Stamps out each case as one test that runs it against both binaries ([`on_both_binaries`]),
/// with its optional attributes (the database switches).
macro_rules! both_binaries {
    ($($(#[$attr:meta])* $name:ident),* $(,)?) => {
        mod both {
            $(
                $(#[$attr])*
                #[test]
                fn $name() {
                    super::on_both_binaries(super::$name);
                }
            )*
        }
    };
}

both_binaries!(
    charges_on_memory,
    charges_on_sqlite,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    charges_on_postgres,
    #[cfg_attr(
        not(mysql_db),
        ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
    )]
    charges_on_mysql,
    crash_on_sqlite,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    crash_on_postgres,
    #[cfg_attr(
        not(mysql_db),
        ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
    )]
    crash_on_mysql,
    killed_first_attempt_on_sqlite,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    killed_first_attempt_on_postgres,
    bad_flags_fail_clearly,
    metrics_are_scraped,
    key_reused_after_its_record_is_gone,
    handler_errors_carry_no_database_text,
    lossy_client_on_sqlite,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    lossy_client_on_postgres,
    #[cfg_attr(
        not(mysql_db),
        ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
    )]
    lossy_client_on_mysql,
);
