//! `idempotent-admin` against a charges server's database (SQLite and PostgreSQL), as real
//! processes: `get` shows a finished record (state, status, fingerprint, times) without its
//! body unless asked; `delete` refuses an in-progress record without `--force` and deletes it
//! with it (the running execution's record is then refused by the fence); a deleted key runs
//! again; an unknown key is exit code 2.
#![allow(clippy::unwrap_used)] // tests unwrap freely

mod common;

use common::{Bin, start};
use serde_json::Value;
use std::process::Command;
use std::time::Duration;

/// Runs the admin binary; its exit code and stdout as JSON (`Null` when empty).
fn admin(database: &str, args: &[&str]) -> (i32, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idempotent-admin"))
        .args(["--database", database])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json = if stdout.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(stdout.trim()).unwrap()
    };
    (
        out.status.code().unwrap(),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn charge(base: &str, account: &str, key: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("{base}/v1/charges"))
        .bearer_auth(account)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount": 700, "currency": "usd", "customer": "cus_admin"}"#)
}

async fn inspect_and_delete(database: &str) {
    let account = format!("acct_adm_{}", uuid::Uuid::new_v4().simple());
    let key = uuid::Uuid::new_v4().to_string();
    let server = start(Bin::Axum, database, &["--commit", "two"]);
    let first = charge(&server.base, &account, &key).send().await.unwrap();
    assert_eq!(first.status(), 201);
    let which = ["--scope", account.as_str(), "--key", key.as_str()];

    let (code, record, _) = admin(database, &[&["get"][..], &which].concat());
    assert_eq!(code, 0);
    assert_eq!(record["state"], "done");
    assert_eq!(record["status"], 201);
    assert_eq!(record["scope"], account.as_str());
    assert_eq!(record["key"], key.as_str());
    assert_eq!(
        record["fingerprint"].as_str().unwrap().len(),
        64,
        "{record}"
    );
    assert!(record["fingerprint_version"].as_u64().is_some(), "{record}");
    assert!(record["expires"].as_f64().unwrap() > record["created"].as_f64().unwrap());
    assert!(
        record.get("body").is_none(),
        "the body only with --show-body"
    );
    assert!(record["body_bytes"].as_u64().unwrap() > 0);
    let (_, with_body, _) = admin(database, &[&["get", "--show-body"][..], &which].concat());
    assert!(with_body["body"].as_str().unwrap().contains("cus_admin"));

    // Deleted: the key is new again, and the same request runs again (a second charge).
    let (code, gone, _) = admin(database, &[&["delete"][..], &which].concat());
    assert_eq!((code, gone["deleted"].as_bool()), (0, Some(true)));
    let (code, _, said) = admin(database, &[&["get"][..], &which].concat());
    assert_eq!(code, 2, "{said}");
    let again = charge(&server.base, &account, &key).send().await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "false");

    // In progress. Plain mode: the claim is committed and no transaction is open while the
    // handler runs (a transactional handler on SQLite would hold the write lock the delete
    // waits for).
    drop(server);
    let slow = start(
        Bin::Axum,
        database,
        &["--plain", "--work-delay", "6s", "--lease", "2s"],
    );
    let running_key = uuid::Uuid::new_v4().to_string();
    let pending = tokio::spawn(charge(&slow.base, &account, &running_key).send());
    let running = ["--scope", account.as_str(), "--key", running_key.as_str()];
    // Until the claim is there (the handler then runs 6 s).
    for _ in 0..50 {
        if admin(database, &[&["get"][..], &running].concat()).0 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, record, said) = admin(database, &[&["delete"][..], &running].concat());
    assert_eq!(code, 3, "{said}");
    assert!(said.contains("--force"), "{said}");
    assert_eq!(record["state"], "in_progress");
    let (code, record, _) = admin(database, &[&["get"][..], &running].concat());
    assert_eq!((code, record["state"].as_str()), (0, Some("in_progress")));
    let (code, gone, _) = admin(database, &[&["delete", "--force"][..], &running].concat());
    assert_eq!((code, gone["state"].as_str()), (0, Some("in_progress")));
    // The first execution ran on (plain mode: its charge is written and its client told so),
    // but the fence refused its record: nothing is stored under the key, so a retry would run
    // again. That is what `--force` risks.
    let late = pending.await.unwrap().unwrap();
    assert_eq!(late.status(), 201);
    let (code, _, _) = admin(database, &[&["get"][..], &running].concat());
    assert_eq!(code, 2);

    // Bad input: a clear message, exit code 1.
    let (code, _, said) = admin(database, &["get", "--scope", "", "--key", "k"]);
    assert_eq!(code, 1);
    assert!(said.contains("--scope"), "{said}");
    let (code, _, said) = admin(database, &["get", "--unscoped", "--key", "a b"]);
    assert_eq!(code, 1);
    assert!(said.contains("--key"), "{said}");
    let (code, _, said) = admin(database, &["get", "--unscoped", "--key", "no-such-key"]);
    assert_eq!(code, 2, "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_on_sqlite() {
    // A path with no database is an error, and creates none.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.db");
    let url = format!("sqlite://{}", missing.display());
    let (code, _, said) = admin(&url, &["get", "--scope", "a", "--key", "k"]);
    assert_eq!(code, 1);
    assert!(said.contains("cannot open"), "{said}");
    assert!(!missing.exists());
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("charges.db").display());
    inspect_and_delete(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn admin_on_postgres() {
    inspect_and_delete(&std::env::var("DATABASE_URL").unwrap()).await;
}
