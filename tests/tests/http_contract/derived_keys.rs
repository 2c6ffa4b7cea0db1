//! Keys derived in a handler (`idem.derive(..)`): stable across re-runs, replays and instances
//! sharing a secret, distinct per caller, key and secret, and refused without a secret.

use crate::{Fw, config, key, problem, serve};
use idempotent_core::http::{Config, ConfigBuilder};
use idempotent_core::{Engine, MemoryStore, Store};

fn with_secret(store: impl Store, secret: &[u8]) -> Config {
    let engine = Engine::builder(store)
        .derive_secret(idempotent_core::DeriveSecret::new(secret).unwrap())
        .build()
        .unwrap();
    ConfigBuilder::<Config>::new(engine).build().unwrap()
}

/// `idem.derive(..)` in a handler: the same on the re-run after a release, in the replay, and
/// on another instance (another store) with the same secret; different per caller, per key
/// and per secret; without a secret the route answers 500 and its handler never runs.
pub(crate) async fn derived_keys_are_stable_across_runs_and_instances(fw: Fw) {
    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    let s = serve(fw, with_secret(MemoryStore::new(), SECRET)).await;
    let k = key();
    // First run: 503 (released) with the key; the retry runs again and derives the same one.
    let first = s
        .post("/derive", "acct_1", Some(&k), "release")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 503);
    let derived = first.text().await.unwrap();
    assert_eq!(derived.len(), 36, "{derived}");
    let again = s
        .post("/derive", "acct_1", Some(&k), "release")
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["idempotent-replayed"], "false");
    assert_eq!(again.text().await.unwrap(), derived);
    assert_eq!(s.runs(), 2);
    let replay = s
        .post("/derive", "acct_1", Some(&k), "release")
        .send()
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), derived);
    // Another caller, another key: other derived keys.
    let other_caller = s
        .post("/derive", "acct_2", Some(&k), "x")
        .send()
        .await
        .unwrap();
    assert_ne!(other_caller.text().await.unwrap(), derived);
    let other_key = s
        .post("/derive", "acct_1", Some(&key()), "x")
        .send()
        .await
        .unwrap();
    assert_ne!(other_key.text().await.unwrap(), derived);
    // Another instance (a restart: a new store, the same secret) derives the same key.
    let restarted = serve(fw, with_secret(MemoryStore::new(), SECRET)).await;
    let there = restarted
        .post("/derive", "acct_1", Some(&k), "x")
        .send()
        .await
        .unwrap();
    assert_eq!(there.text().await.unwrap(), derived);
    let rotated = serve(fw, with_secret(MemoryStore::new(), &[9; 32])).await;
    let elsewhere = rotated
        .post("/derive", "acct_1", Some(&k), "x")
        .send()
        .await
        .unwrap();
    assert_ne!(elsewhere.text().await.unwrap(), derived);
    // A GET ignores the key: each request is an operation of its own, with random keys.
    let get = || {
        s.client
            .get(format!("{}/derive", s.base))
            .header("authorization", "Bearer acct_1")
            .header("idempotency-key", &k)
            .send()
    };
    let (a, b) = (get().await.unwrap(), get().await.unwrap());
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    let (a, b) = (a.text().await.unwrap(), b.text().await.unwrap());
    assert!(a.len() == 36 && a != b && a != derived, "{a} {b}");
    // No secret: refused before the handler runs, never a key that would change.
    let bare = serve(fw, config(MemoryStore::new())).await;
    let res = bare
        .post("/derive", "acct_1", Some(&k), "x")
        .send()
        .await
        .unwrap();
    problem(res, 500, "idempotency-misconfigured").await;
    assert_eq!(bare.runs(), 0);
}
