//! A helper process for the cross-process SQLite race test: claims `keys` keys `dups` times
//! each, concurrently, on a shared database file; completes what it wins; prints one line per
//! claim: `<key>\t<claimed|replay|busy|mismatch|error>\t<detail>`.
//!
//! Usage: `sqlite_racer <db-url> <keys> <dups> <label> <start-at-unix-ms>`

use idempotent_core::{fingerprint::*, store::*, *};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, keys, dups, label, start] = args.as_slice() else {
        eprintln!("usage: sqlite_racer <db-url> <keys> <dups> <label> <start-at-unix-ms>");
        std::process::exit(2);
    };
    let keys: usize = keys.parse().expect("keys");
    let dups: usize = dups.parse().expect("dups");
    let start: u64 = start.parse().expect("start");
    let store = Arc::new(SqliteStore::connect(url).await.expect("open"));
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    tokio::time::sleep(Duration::from_millis(start.saturating_sub(now))).await;

    let fp = Fingerprint::compute(&FingerprintInput {
        method: "POST",
        path: "/race",
        query: None,
        content_type: None,
        body: b"same",
    });
    let scope = Scope::new("racers").expect("scope");
    let mut lines = Vec::with_capacity(keys * dups);
    for chunk in (0..keys).collect::<Vec<_>>().chunks(25) {
        let mut tasks = Vec::new();
        for &k in chunk {
            for _ in 0..dups {
                let (store, scope, label) = (store.clone(), scope.clone(), label.clone());
                tasks.push(tokio::spawn(async move {
                    let key = RecordKey::new(
                        scope,
                        IdempotencyKey::parse(format!("key-{k}").as_bytes()).expect("key"),
                    );
                    let req = ClaimRequest {
                        key: &key,
                        fingerprint: &fp,
                        lease: Duration::from_secs(60),
                        ttl: Duration::from_secs(3600),
                        max_stored: 0,
                    };
                    match store.claim(req).await {
                        Ok(ClaimOutcome::Claimed(lease)) => {
                            let body = format!("{label}:{k}");
                            let outcome = StoredResponse::new(201, body.clone()).into();
                            match store.complete(&key, lease.token, &outcome, req.ttl).await {
                                Ok(()) => format!("{k}\tclaimed\t{body}"),
                                Err(e) => format!("{k}\terror\tcomplete: {e}"),
                            }
                        }
                        Ok(ClaimOutcome::Replay(StoredOutcome::Response(r))) => {
                            format!("{k}\treplay\t{}", String::from_utf8_lossy(&r.body))
                        }
                        Ok(ClaimOutcome::InProgress { .. }) => format!("{k}\tbusy\t-"),
                        Ok(other) => format!("{k}\tmismatch\t{other:?}"),
                        Err(e) => format!("{k}\terror\t{e}"),
                    }
                }));
            }
        }
        for t in tasks {
            lines.push(t.await.expect("task"));
        }
    }
    println!("{}", lines.join("\n"));
}
