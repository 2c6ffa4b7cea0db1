//! The small examples as real processes, each bounded in time (a child is killed when its test
//! ends, passed or failed): `axum-minimal` and `actix-minimal` on a free 127.0.0.1 port (the
//! first POST runs, its retry is the replay, the key with another body a 422, another caller's
//! key its own, SIGINT a clean exit); `tx-sqlite` the same, plus one order row per key, with
//! its record, kept across a restart; `consumer` handles each message once and replays its
//! duplicates.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

/// The longest any step waits: a start, a request, an exit.
const BOUND: Duration = Duration::from_secs(30);

/// A running example; killed on drop.
struct Running {
    child: Child,
    /// Its stdout, a line at a time (read by a thread, so no read blocks a test forever).
    lines: Receiver<String>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    fn spawn(bin: &str, args: &[&str]) -> Self {
        let mut child = Command::new(bin)
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (send, lines) = channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Running { child, lines }
    }

    /// The next line of stdout, or a failure after [`BOUND`].
    fn line(&self) -> String {
        self.lines
            .recv_timeout(BOUND)
            .unwrap_or_else(|e| panic!("no line from the example within {BOUND:?}: {e}"))
    }

    /// Its exit status, within [`BOUND`].
    fn exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + BOUND;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "still running after {BOUND:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// All of stdout (to its end), once it exited successfully.
    fn output(mut self) -> Vec<String> {
        let status = self.exit();
        assert!(status.success(), "{status:?}");
        let mut lines = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(BOUND) {
            lines.push(line);
        }
        lines
    }
}

/// A server example listening on a free port: it and its base URL.
fn serve(bin: &str, extra: &[&str]) -> (Running, String) {
    let server = Running::spawn(bin, &[&["--listen", "127.0.0.1:0"][..], extra].concat());
    let first = server.line();
    let base = first
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("first line: {first:?}"))
        .to_owned();
    (server, base)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(BOUND).build().unwrap()
}

/// POST /v1/orders as `token` with `key`: status, `Idempotent-Replayed`, body.
async fn order(base: &str, token: &str, key: &str, body: &str) -> (u16, String, String) {
    let res = client()
        .post(format!("{base}/v1/orders"))
        .bearer_auth(token)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .map_or("(none)", |v| v.to_str().unwrap())
        .to_owned();
    (res.status().as_u16(), replayed, res.text().await.unwrap())
}

const BOOK: &str = r#"{"item": "book", "quantity": 2}"#;
const BOOK_REORDERED: &str = r#"{ "quantity": 2, "item": "book" }"#;
const PEN: &str = r#"{"item": "pen", "quantity": 2}"#;

/// The contract every server example keeps; the first order's body.
async fn contract(base: &str) -> String {
    let key = uuid::Uuid::new_v4().to_string();
    let (status, replayed, first) = order(base, "tok_alice", &key, BOOK).await;
    assert_eq!((status, replayed.as_str()), (201, "false"), "{first}");
    // The retry (keys in another order): the stored answer, byte for byte.
    let (status, replayed, again) = order(base, "tok_alice", &key, BOOK_REORDERED).await;
    assert_eq!((status, replayed.as_str()), (201, "true"), "{again}");
    assert_eq!(again, first, "a replay is the first answer");
    // The same key for another order.
    let (status, _, problem) = order(base, "tok_alice", &key, PEN).await;
    assert_eq!(status, 422, "{problem}");
    // Another caller's key is its own: a first execution, another order.
    let (status, replayed, bobs) = order(base, "tok_bob", &key, BOOK).await;
    assert_eq!((status, replayed.as_str()), (201, "false"), "{bobs}");
    assert_ne!(bobs, first);
    // No authenticated caller, no scope: refused before any claim.
    let (status, _, _) = order(base, "tok_mallory", &key, BOOK).await;
    assert_eq!(status, 401);
    first
}

/// SIGINT: the server stops accepting, drains and exits cleanly.
fn stops_on_sigint(mut server: Running) {
    let pid = server.child.id().to_string();
    let sent = Command::new("kill").args(["-INT", &pid]).status().unwrap();
    assert!(sent.success());
    let status = server.exit();
    assert!(status.success(), "clean exit after draining: {status:?}");
    assert!(server.line().starts_with("stopped: "));
}

#[tokio::test]
async fn axum_minimal() {
    let (server, base) = serve(env!("CARGO_BIN_EXE_axum-minimal"), &[]);
    contract(&base).await;
    stops_on_sigint(server);
}

#[tokio::test]
async fn actix_minimal() {
    let (server, base) = serve(env!("CARGO_BIN_EXE_actix-minimal"), &[]);
    contract(&base).await;
    stops_on_sigint(server);
}

/// The account's order rows and idempotency records, read from the database file.
async fn rows(url: &str, account: &str) -> (Vec<Value>, i64) {
    let db = sqlx::SqlitePool::connect(url).await.unwrap();
    let orders: Vec<(i64, String, i64)> =
        sqlx::query_as("SELECT id, item, quantity FROM orders WHERE account = ? ORDER BY id")
            .bind(account)
            .fetch_all(&db)
            .await
            .unwrap();
    let records = "SELECT count(*) FROM idempotency_records WHERE scope = ?";
    let records = sqlx::query_scalar(records)
        .bind(account)
        .fetch_one(&db)
        .await
        .unwrap();
    db.close().await;
    let orders = orders.into_iter().map(
        |(id, item, quantity)| serde_json::json!({"id": id, "item": item, "quantity": quantity}),
    );
    (orders.collect(), records)
}

#[tokio::test]
async fn tx_sqlite_writes_one_row_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("orders.db").display());
    let bin = env!("CARGO_BIN_EXE_tx-sqlite");
    let (server, base) = serve(bin, &["--database", &url]);
    let first: Value = serde_json::from_str(&contract(&base).await).unwrap();
    // The replay and the 422 wrote nothing: one row, the one the first answer names, and the
    // record stored with it.
    assert_eq!(rows(&url, "acct_alice").await, (vec![first], 1));
    assert_eq!(rows(&url, "acct_bob").await.0.len(), 1);
    // Both are in the file: a new process replays, and a new key is a new row.
    drop(server);
    let (_server, base) = serve(bin, &["--database", &url]);
    let key = uuid::Uuid::new_v4().to_string();
    let (_, _, second) = order(&base, "tok_alice", &key, PEN).await;
    let (status, replayed, again) = order(&base, "tok_alice", &key, PEN).await;
    assert_eq!((status, replayed.as_str(), &again), (201, "true", &second));
    let (orders, records) = rows(&url, "acct_alice").await;
    assert_eq!(
        (orders.len(), records),
        (2, 2),
        "one row per key: {orders:?}"
    );
}

#[test]
fn consumer_handles_each_message_once() {
    let lines = Running::spawn(env!("CARGO_BIN_EXE_consumer"), &[]).output();
    let count = |prefix: &str| lines.iter().filter(|l| l.starts_with(prefix)).count();
    // Each message's body ran once, under its (tenant, id).
    for message in ["acme/evt_1", "acme/evt_2", "globex/evt_1"] {
        assert_eq!(
            count(&format!("ran {message} ")),
            1,
            "{message}: {lines:#?}"
        );
        assert_eq!(count(&format!("{message}: handled")), 1, "{lines:#?}");
    }
    // The duplicates got the first run's output without running.
    for message in ["acme/evt_1", "acme/evt_2"] {
        let answer = |what: &str| {
            let line = lines
                .iter()
                .find(|l| l.starts_with(&format!("{message}: {what}")));
            line.unwrap_or_else(|| panic!("no {what} {message}: {lines:#?}"))
                .split_once('(')
                .unwrap()
                .1
                .to_owned()
        };
        assert_eq!(answer("replayed"), answer("handled"));
    }
    assert_eq!(count("acme/evt_2: refused"), 1, "{lines:#?}");
    assert_eq!(
        lines.last().map(String::as_str),
        Some("3 handled, 2 replayed, 1 refused; 3 runs")
    );
}
