//! Resident memory of the memory store holding 1,000,000 finished records with 200-byte
//! response bodies (`RECORDS` overrides the count), against the raw payload: scope + key +
//! fingerprint + stored headers + body bytes. Linux only (reads `/proc/self/statm`).
//!
//! `cargo bench -p idempotent-core --bench memory_footprint`

use idempotent_core::{engine::*, fingerprint::*, store::*, *};

fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let records: u64 = std::env::var("RECORDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let store = MemoryStore::builder()
        // One scope, as many records as the bench takes: no bound may refuse one.
        .max_entries(usize::MAX)
        .max_per_scope(usize::MAX)
        .max_bytes(u64::MAX)
        .max_bytes_per_scope(u64::MAX)
        .build();
    let engine = Engine::new(store.clone());
    let policy = Policy::default();
    let body = vec![b'x'; 200];
    let scope = "acct_000000000001";
    let fingerprint = Fingerprint::compute(&FingerprintInput {
        method: "POST",
        path: "/v1/charges",
        query: None,
        content_type: Some("application/json"),
        body: br#"{"amount":500}"#,
    });
    let headers = [("content-type", &b"application/json"[..])];
    let Some(before) = resident_bytes() else {
        eprintln!("memory_footprint: /proc/self/statm is not readable here; skipped");
        return;
    };
    let mut raw: u64 = 0;
    rt.block_on(async {
        for i in 0..records {
            let key = format!("8e03978e-40d5-43e8-bc93-{i:012}");
            raw += (scope.len() + key.len() + 33 + body.len()) as u64
                + headers
                    .iter()
                    .map(|(n, v)| (n.len() + v.len()) as u64)
                    .sum::<u64>();
            let request = ExecuteRequest {
                scope: Scope::new(scope).expect("scope"),
                key: IdempotencyKey::parse(key.as_bytes()),
                fingerprint,
            };
            let mut stored = StoredResponse::new(201, body.clone());
            for (n, v) in headers {
                stored = stored.with_header(n, v);
            }
            let Begin::Claimed(execution) = engine.begin(request, &policy).await else {
                panic!("record {i} was not claimed");
            };
            let recorded = execution.finish(stored.into()).await;
            assert!(matches!(recorded, Recorded::Stored), "record {i}");
        }
    });
    let after = resident_bytes().unwrap_or(before);
    assert_eq!(store.len() as u64, records);
    let resident = after.saturating_sub(before);
    println!(
        "memory store, {records} finished records, 200-byte bodies: resident {:.1} MiB, raw payload {:.1} MiB, ratio {:.2} ({:.0} bytes per record, {:.0} raw); charged to the byte budgets {:.1} MiB ({:.0} per record)",
        resident as f64 / 1048576.0,
        raw as f64 / 1048576.0,
        resident as f64 / raw as f64,
        resident as f64 / records as f64,
        raw as f64 / records as f64,
        store.bytes() as f64 / 1048576.0,
        store.bytes() as f64 / records as f64,
    );
}
