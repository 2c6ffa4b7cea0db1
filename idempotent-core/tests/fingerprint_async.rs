//! `RequestHead::fingerprint_async`: the same fingerprint as `fingerprint`, and a large body's
//! computed off the async worker, so the worker's other tasks keep running meanwhile.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_core::__private::RequestHead;
use idempotent_core::http::FINGERPRINT_INLINE_MAX;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

fn head(content_type: &str) -> RequestHead<'_> {
    RequestHead {
        method: "POST",
        path: "/v1/charges",
        query: Some("x=1"),
        content_type: Some(content_type),
    }
}

#[tokio::test(flavor = "current_thread")]
async fn same_fingerprint_on_both_sides_of_the_threshold() {
    for len in [
        0,
        FINGERPRINT_INLINE_MAX,
        FINGERPRINT_INLINE_MAX + 1,
        1 << 20,
    ] {
        let form = "b=2&a=1&".repeat(len / 8).into_bytes();
        let json = format!("[{}0]", "{\"b\":1,\"a\":2},".repeat(len / 14)).into_bytes();
        for (ct, body) in [
            ("application/x-www-form-urlencoded", form),
            ("application/json", json),
        ] {
            let h = head(ct);
            assert_eq!(
                h.fingerprint_async(body.clone()).await,
                h.fingerprint(&body)
            );
        }
    }
}

/// On a single-threaded runtime (actix-web's kind), another task makes progress while a
/// large body is fingerprinted: the work is on the blocking pool, not on the worker.
#[tokio::test(flavor = "current_thread")]
async fn a_large_body_leaves_the_worker_free() {
    let ticks = Arc::new(AtomicUsize::new(0));
    let ticker = {
        let ticks = Arc::clone(&ticks);
        tokio::spawn(async move {
            loop {
                ticks.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        })
    };
    tokio::task::yield_now().await;
    let before = ticks.load(Ordering::Relaxed);
    // One-byte fields out of order: the costliest form per byte (tens of ms even optimised).
    let body = "b&a&".repeat(1 << 19).into_bytes();
    let h = head("application/x-www-form-urlencoded");
    let fingerprint = h.fingerprint_async(body.clone()).await;
    let during = ticks.load(Ordering::Relaxed) - before;
    ticker.abort();
    assert_eq!(fingerprint, h.fingerprint(&body));
    assert!(
        during >= 2,
        "the worker ran {during} ticks while fingerprinting 2 MiB"
    );
}
