//! Idempotent functions (`idempotent_core::call`) on every store (memory, a SQLite file,
//! PostgreSQL): once per (scope, key), the output returned on redelivery, errors released or
//! stored, mismatches, concurrent duplicates refused or waited for, derived keys.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_core::call::{Call, CallError, Calls, Concurrent, InvalidCall, StoredError};
use idempotent_core::{DeriveSecret, Engine, IdempotencyKey, MemoryStore, Scope, Store};
use idempotent_tests::Fixture;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[derive(Debug, Clone, Serialize)]
struct PaymentEvent {
    id: String,
    tenant: String,
    amount: i64,
}

fn event(amount: i64) -> PaymentEvent {
    PaymentEvent {
        id: format!("evt_{}", uuid::Uuid::new_v4().simple()),
        tenant: "tenant_1".into(),
        amount,
    }
}

fn call(name: &'static str, msg: &PaymentEvent) -> Call {
    Call::new(
        name,
        Scope::new(&msg.tenant).unwrap(),
        IdempotencyKey::opaque(msg.id.as_str()).unwrap(),
        msg,
    )
    .unwrap()
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    booked: i64,
    run: usize,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum BookError {
    Declined,
    Unavailable,
}

impl StoredError for BookError {
    fn is_stored(&self) -> bool {
        matches!(self, BookError::Declined)
    }
}

struct Memory;

#[async_trait::async_trait]
impl Fixture for Memory {
    async fn fresh(&self) -> Arc<dyn Store> {
        Arc::new(MemoryStore::new())
    }
    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
}

async fn calls(fixture: &impl Fixture) -> Calls {
    Calls::new(engine(fixture.fresh().await, None))
}

/// [`calls`] over an engine holding `secret`, for functions that derive keys.
async fn calls_with_secret(fixture: &impl Fixture, secret: DeriveSecret) -> Calls {
    Calls::new(engine(fixture.fresh().await, Some(secret)))
}

/// An engine over `store` with a 5 s lease (and `secret`, if any); a wait is at most that.
fn engine(store: Arc<dyn Store>, secret: Option<DeriveSecret>) -> Engine {
    let builder = Engine::builder_from_arc(store).lease(Duration::from_secs(5));
    match secret {
        Some(secret) => builder.derive_secret(secret),
        None => builder,
    }
    .build()
    .unwrap()
}

/// Three deliveries, one run: every delivery gets the first run's output.
async fn runs_once_and_returns_the_output(f: &impl Fixture) {
    let calls = calls(f).await;
    let msg = event(500);
    let runs = AtomicUsize::new(0);
    for _ in 0..3 {
        let out: Result<Receipt, CallError<BookError>> = calls
            .run(call("book", &msg), || async {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                Ok(Receipt {
                    booked: msg.amount,
                    run,
                })
            })
            .await;
        assert_eq!(
            out.unwrap(),
            Receipt {
                booked: 500,
                run: 1
            }
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// An error releases the key: the next delivery runs again; after its success, replays.
async fn errors_release_the_key(f: &impl Fixture) {
    let calls = calls(f).await;
    let msg = event(1);
    let runs = AtomicUsize::new(0);
    let attempt = || async {
        let n = runs.fetch_add(1, Ordering::SeqCst);
        if n == 0 {
            Err(BookError::Unavailable)
        } else {
            Ok(Receipt { booked: 1, run: n })
        }
    };
    let first = calls.run(call("book", &msg), attempt).await;
    assert!(matches!(
        first,
        Err(CallError::Failed(BookError::Unavailable))
    ));
    assert_eq!(calls.run(call("book", &msg), attempt).await.unwrap().run, 1);
    assert_eq!(calls.run(call("book", &msg), attempt).await.unwrap().run, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// An error type that opts in: final errors are stored and returned on redelivery, others
/// release the key.
async fn final_errors_are_stored(f: &impl Fixture) {
    let calls = calls(f).await;
    let msg = event(2);
    let runs = AtomicUsize::new(0);
    for _ in 0..3 {
        let out: Result<Receipt, _> = calls
            .run_storing(call("book", &msg), || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Err(BookError::Declined)
            })
            .await;
        assert!(matches!(out, Err(CallError::Failed(BookError::Declined))));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let other = event(3);
    for _ in 0..2 {
        let out: Result<Receipt, _> = calls
            .run_storing(call("book", &other), || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Err(BookError::Unavailable)
            })
            .await;
        assert!(matches!(
            out,
            Err(CallError::Failed(BookError::Unavailable))
        ));
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "retryable errors are not stored"
    );
}

/// The key with other arguments is a mismatch; another function runs on its own records; a
/// stored output of another type does not decode.
async fn mismatches_and_types(f: &impl Fixture) {
    let calls = calls(f).await;
    let msg = event(4);
    let ok: Result<u32, CallError<BookError>> =
        calls.run(call("book", &msg), || async { Ok(7) }).await;
    assert_eq!(ok.unwrap(), 7);
    let changed = PaymentEvent {
        amount: 5,
        ..msg.clone()
    };
    let out: Result<u32, CallError<BookError>> = calls
        .run(call("book", &changed), || async { panic!("must not run") })
        .await;
    assert!(matches!(out, Err(CallError::Mismatch)), "{out:?}");
    // Another function on the same message has records of its own: it runs (fan-out).
    let out: Result<u32, CallError<BookError>> =
        calls.run(call("notify", &msg), || async { Ok(9) }).await;
    assert_eq!(out.unwrap(), 9);
    let out: Result<String, CallError<BookError>> = calls
        .run(call("book", &msg), || async { panic!("must not run") })
        .await;
    assert!(matches!(out, Err(CallError::Decode(_))), "{out:?}");
    // Another scope with the same key is another call altogether.
    let elsewhere = PaymentEvent {
        tenant: "tenant_2".into(),
        ..msg.clone()
    };
    let out: Result<u32, CallError<BookError>> = calls
        .run(call("book", &elsewhere), || async { Ok(8) })
        .await;
    assert_eq!(out.unwrap(), 8);
}

/// A duplicate while the first runs: refused at once, or (waiting) given the first's output;
/// a wait that runs out is refused too.
async fn concurrent_duplicates(f: &impl Fixture) {
    let store = f.fresh().await;
    let engine = engine(store, None);
    let refuse = Calls::new(engine.clone());
    let wait = refuse
        .clone()
        .concurrent(Concurrent::Wait(Duration::from_secs(5)));
    let short = refuse
        .clone()
        .concurrent(Concurrent::Wait(Duration::from_millis(100)));
    let msg = event(6);
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let first = tokio::spawn({
        let (refuse, msg, runs, gate) = (refuse.clone(), msg.clone(), runs.clone(), gate.clone());
        async move {
            let out: Result<usize, CallError<BookError>> = refuse
                .run(call("book", &msg), || async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    gate.notified().await;
                    Ok(41)
                })
                .await;
            out
        }
    });
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let busy: Result<usize, CallError<BookError>> = refuse
        .run(call("book", &msg), || async { panic!("must not run") })
        .await;
    assert!(
        matches!(busy, Err(CallError::InProgress { .. })),
        "{busy:?}"
    );
    let timed_out: Result<usize, CallError<BookError>> = short
        .run(call("book", &msg), || async { panic!("must not run") })
        .await;
    assert!(
        matches!(timed_out, Err(CallError::InProgress { .. })),
        "{timed_out:?}"
    );
    let waiter = tokio::spawn({
        let (wait, msg) = (wait.clone(), msg.clone());
        async move {
            let out: Result<usize, CallError<BookError>> = wait
                .run(call("book", &msg), || async { panic!("must not run") })
                .await;
            out
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.notify_one();
    assert_eq!(first.await.unwrap().unwrap(), 41);
    assert_eq!(waiter.await.unwrap().unwrap(), 41);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A panic releases the key; the next delivery runs.
async fn panics_release_the_key(f: &impl Fixture) {
    let calls = calls(f).await;
    let msg = event(7);
    let boom = tokio::spawn({
        let (calls, msg) = (calls.clone(), msg.clone());
        async move {
            let _: Result<u8, CallError<BookError>> = calls
                .run(call("book", &msg), || async { panic!("consumer exploded") })
                .await;
        }
    });
    assert!(boom.await.unwrap_err().is_panic());
    let out: Result<u8, CallError<BookError>> =
        calls.run(call("book", &msg), || async { Ok(1) }).await;
    assert_eq!(out.unwrap(), 1);
}

/// The context derives the same downstream key on every run of one (scope, key), and the
/// function does not run without a secret.
async fn derived_keys(f: &impl Fixture) {
    let secret = DeriveSecret::new([3u8; 32]).unwrap();
    let calls = calls_with_secret(f, secret).await;
    let msg = event(8);
    let mut seen = Vec::new();
    for fail in [true, false] {
        let c = call("book", &msg);
        let idem = calls.context::<BookError>(&c).unwrap();
        let out: Result<String, CallError<BookError>> = calls
            .run(c, || async move {
                let key = idem.derive("payment-provider").to_string();
                if fail {
                    Err(BookError::Unavailable)
                } else {
                    Ok(key)
                }
            })
            .await;
        match out {
            Err(CallError::Failed(_)) => {}
            Ok(key) => seen.push(key),
            other => panic!("{other:?}"),
        }
    }
    let again: Result<String, CallError<BookError>> = calls
        .run(call("book", &msg), || async { panic!("must not run") })
        .await;
    seen.push(again.unwrap());
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0], seen[1]);
    let bare = Calls::new(Engine::new(MemoryStore::new()));
    let out = bare.context::<BookError>(&call("book", &msg));
    assert!(matches!(out, Err(CallError::Misconfigured(_))), "{out:?}");
}

/// An output that cannot be serialized: the work ran once and is never re-run; every
/// delivery says it was not stored.
async fn unstorable_outputs_never_run_twice(f: &impl Fixture) {
    let calls = calls(f).await;
    let msg = event(9);
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let out: Result<std::collections::HashMap<(u8, u8), u8>, CallError<BookError>> = calls
            .run(call("book", &msg), || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok([((1, 2), 3)].into_iter().collect())
            })
            .await;
        assert!(matches!(out, Err(CallError::NotStored)), "{out:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The attribute's function mode: the same semantics through `#[idempotent(key_from = …)]`.
#[idempotent_core::idempotent(
    name = "book_with_the_attribute",
    key_from = "msg.id",
    scope = "msg.tenant",
    lease = "5s"
)]
async fn book_with_the_attribute(
    calls: &Calls,
    msg: &PaymentEvent,
    #[idempotent(skip)] runs: &AtomicUsize,
) -> Result<Receipt, BookError> {
    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
    if msg.amount < 0 {
        return Err(BookError::Unavailable);
    }
    Ok(Receipt {
        booked: msg.amount,
        run,
    })
}

async fn the_attribute_runs_once(f: &impl Fixture) {
    let calls = calls(f).await;
    let runs = AtomicUsize::new(0);
    let msg = event(13);
    for _ in 0..3 {
        let out = book_with_the_attribute(&calls, &msg, &runs).await.unwrap();
        assert_eq!(out, Receipt { booked: 13, run: 1 });
    }
    let changed = PaymentEvent {
        amount: 14,
        ..msg.clone()
    };
    let out = book_with_the_attribute(&calls, &changed, &runs).await;
    assert!(matches!(out, Err(CallError::Mismatch)), "{out:?}");
    let failing = event(-1);
    for _ in 0..2 {
        let out = book_with_the_attribute(&calls, &failing, &runs).await;
        assert!(matches!(
            out,
            Err(CallError::Failed(BookError::Unavailable))
        ));
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "errors release: each delivery ran"
    );
    let bad_key = PaymentEvent {
        id: String::new(),
        ..msg.clone()
    };
    let out = book_with_the_attribute(&calls, &bad_key, &runs).await;
    assert!(matches!(out, Err(CallError::InvalidKey(_))), "{out:?}");
}

/// A function's key is its message id as it is, byte for byte: no trimming, no unquoting (it
/// is no `Idempotency-Key` header). `m1`, ` m1`, `m1 ` and `"m1"` are four messages, each run
/// once and each replayed its own output; ids with spaces, tabs or non-ASCII text are keys
/// too. Refused: an empty id, one over 255 bytes, one holding NUL (no SQL store keeps it).
async fn message_ids_are_opaque_keys(f: &impl Fixture) {
    let calls = calls(f).await;
    let runs = AtomicUsize::new(0);
    let m1 = format!("m1-{}", uuid::Uuid::new_v4().simple());
    let ids = [
        m1.clone(),
        format!(" {m1}"),
        format!("{m1} "),
        format!("\"{m1}\""),
        format!("{m1}\t"),
        format!("é {m1}"),
        format!("{m1}{}", "é".repeat(100)),
    ];
    for delivery in 0..2 {
        for (amount, id) in (0..).zip(&ids) {
            let msg = PaymentEvent {
                id: id.clone(),
                tenant: "tenant_1".into(),
                amount,
            };
            let out = book_with_the_attribute(&calls, &msg, &runs).await;
            assert!(
                matches!(out, Ok(Receipt { booked, .. }) if booked == amount),
                "delivery {delivery} of {id:?}: {out:?}"
            );
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        ids.len(),
        "each message ran once"
    );
    let calls = &calls;
    let refused = |id: String| {
        let msg = PaymentEvent {
            id,
            tenant: "tenant_1".into(),
            amount: 1,
        };
        async move { book_with_the_attribute(calls, &msg, &AtomicUsize::new(0)).await }
    };
    let out = refused(String::new()).await;
    assert!(
        matches!(
            out,
            Err(CallError::InvalidKey(idempotent_core::KeyError::Empty))
        ),
        "{out:?}"
    );
    // 256 bytes (128 two-byte characters); 255 bytes is a key.
    let out = refused("é".repeat(128)).await;
    assert!(
        matches!(
            out,
            Err(CallError::InvalidKey(idempotent_core::KeyError::TooLong {
                len: 256
            }))
        ),
        "{out:?}"
    );
    let longest = format!("{}k", "é".repeat(127));
    assert_eq!(longest.len(), 255);
    assert!(refused(longest).await.is_ok());
    let out = refused("m\0".into()).await;
    assert!(
        matches!(&out, Err(CallError::InvalidKey(e)) if e.to_string().contains("NUL")),
        "{out:?}"
    );
}

/// How often `book_by_id` ran for each message id (ids are unique per test).
static RUNS_BY_ID: std::sync::Mutex<std::collections::BTreeMap<String, usize>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// The key is one parameter and the message's contents are others: every input is part of
/// the fingerprint, not only the parameter `key_from` starts at.
#[idempotent_core::idempotent(name = "book_by_id", key_from = "id", scope = "tenant")]
async fn book_by_id(
    calls: &Calls,
    id: &str,
    tenant: &str,
    amount: i64,
    note: Option<String>,
) -> Result<i64, BookError> {
    let _ = (tenant, note);
    *RUNS_BY_ID.lock().unwrap().entry(id.to_owned()).or_default() += 1;
    Ok(amount)
}

/// The same id with other contents in another parameter is `Mismatch`, as documented, never
/// a replay of the first message's output; the same contents replay.
async fn every_input_is_fingerprinted(f: &impl Fixture) {
    let calls = calls(f).await;
    let id = format!("evt_{}", uuid::Uuid::new_v4().simple());
    let runs = || RUNS_BY_ID.lock().unwrap().get(&id).copied().unwrap_or(0);
    for _ in 0..2 {
        assert_eq!(book_by_id(&calls, &id, "t1", 5, None).await.unwrap(), 5);
    }
    assert_eq!(runs(), 1);
    let other_amount = book_by_id(&calls, &id, "t1", 6, None).await;
    assert!(
        matches!(other_amount, Err(CallError::Mismatch)),
        "{other_amount:?}"
    );
    let other_note = book_by_id(&calls, &id, "t1", 5, Some("gift".into())).await;
    assert!(
        matches!(other_note, Err(CallError::Mismatch)),
        "{other_note:?}"
    );
    // Another caller is another record (the scope), whatever its contents.
    assert_eq!(book_by_id(&calls, &id, "t2", 6, None).await.unwrap(), 6);
    assert_eq!(runs(), 2);
}

/// The attribute with a derived-key context, stored final errors and a wait.
#[idempotent_core::idempotent(
    name = "settle_with_the_attribute",
    key_from = "msg.id",
    scope = "msg.tenant",
    store_errors,
    wait = "5s"
)]
async fn settle_with_the_attribute(
    calls: &Calls,
    idem: &idempotent_core::Idempotent,
    msg: &PaymentEvent,
    #[idempotent(skip)] runs: &AtomicUsize,
) -> Result<String, BookError> {
    runs.fetch_add(1, Ordering::SeqCst);
    if msg.amount < 0 {
        return Err(BookError::Declined);
    }
    Ok(idem.derive("psp").to_string())
}

async fn the_attribute_stores_final_errors_and_derives(f: &impl Fixture) {
    let calls = calls_with_secret(f, DeriveSecret::new([5u8; 32]).unwrap()).await;
    let runs = AtomicUsize::new(0);
    let msg = event(15);
    let first = settle_with_the_attribute(&calls, &msg, &runs)
        .await
        .unwrap();
    assert_eq!(first.len(), 36);
    assert_eq!(
        settle_with_the_attribute(&calls, &msg, &runs)
            .await
            .unwrap(),
        first
    );
    let declined = event(-5);
    for _ in 0..2 {
        let out = settle_with_the_attribute(&calls, &declined, &runs).await;
        assert!(
            matches!(out, Err(CallError::Failed(BookError::Declined))),
            "{out:?}"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "stored: the decline ran once"
    );
    // The same store under an engine without a secret: the function is refused, never run.
    let bare = Calls::new(Engine::from_arc(calls.engine().store().clone()));
    let out = settle_with_the_attribute(&bare, &event(16), &runs).await;
    assert!(matches!(out, Err(CallError::Misconfigured(_))), "{out:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// What each of the `settle` functions below does, whatever its module: derives the
/// provider's key from its own, records it, and fails if asked to (so a delivery runs again).
fn settle_body(
    idem: &idempotent_core::Idempotent,
    derived: &std::sync::Mutex<Vec<String>>,
    fail: bool,
) -> Result<String, BookError> {
    let key = idem.derive("psp").to_string();
    derived.lock().unwrap().push(key.clone());
    if fail {
        return Err(BookError::Unavailable);
    }
    Ok(key)
}

/// A function's records are its `name`'s, not its module path's: `settle` moved to another
/// module and renamed between deliveries (a deploy) keeps its records and derived keys.
mod before_the_move {
    use super::{BookError, Calls, PaymentEvent};
    use std::sync::Mutex;

    #[idempotent_core::idempotent(name = "settle", key_from = "msg.id", scope = "msg.tenant")]
    pub(super) async fn settle(
        calls: &Calls,
        idem: &idempotent_core::Idempotent,
        msg: &PaymentEvent,
        #[idempotent(skip)] derived: &Mutex<Vec<String>>,
        #[idempotent(skip)] fail: bool,
    ) -> Result<String, BookError> {
        super::settle_body(idem, derived, fail)
    }
}

/// The same function after the move: another module, another Rust name, the same `name`.
mod after_the_move {
    use super::{BookError, Calls, PaymentEvent};
    use std::sync::Mutex;

    #[idempotent_core::idempotent(name = "settle", key_from = "msg.id", scope = "msg.tenant")]
    pub(super) async fn settle_payment(
        calls: &Calls,
        idem: &idempotent_core::Idempotent,
        msg: &PaymentEvent,
        #[idempotent(skip)] derived: &Mutex<Vec<String>>,
        #[idempotent(skip)] fail: bool,
    ) -> Result<String, BookError> {
        super::settle_body(idem, derived, fail)
    }
}

/// Another `name` in the same module as the original: another identity.
mod renamed_identity {
    use super::{BookError, Calls, PaymentEvent};
    use std::sync::Mutex;

    #[idempotent_core::idempotent(name = "settle_v2", key_from = "msg.id", scope = "msg.tenant")]
    pub(super) async fn settle(
        calls: &Calls,
        idem: &idempotent_core::Idempotent,
        msg: &PaymentEvent,
        #[idempotent(skip)] derived: &Mutex<Vec<String>>,
        #[idempotent(skip)] fail: bool,
    ) -> Result<String, BookError> {
        super::settle_body(idem, derived, fail)
    }
}

async fn the_name_is_the_identity_not_the_module_path(f: &impl Fixture) {
    let calls = calls_with_secret(f, DeriveSecret::new([7u8; 32]).unwrap()).await;
    let msg = event(17);
    let derived = std::sync::Mutex::new(Vec::new());
    let seen = || derived.lock().unwrap().clone();
    // The first delivery fails after deriving its downstream key: the key is released.
    let first = before_the_move::settle(&calls, &msg, &derived, true).await;
    assert!(
        matches!(first, Err(CallError::Failed(BookError::Unavailable))),
        "{first:?}"
    );
    // The redelivery reaches the moved and renamed function: it derives the same key.
    let out = after_the_move::settle_payment(&calls, &msg, &derived, false)
        .await
        .unwrap();
    assert_eq!(seen().len(), 2);
    assert_eq!(
        seen()[0],
        seen()[1],
        "a moved function derives the same downstream key"
    );
    // The function after the move stored the output under the shared identity: a delivery to
    // either one replays it without running.
    for _ in 0..2 {
        let again = before_the_move::settle(&calls, &msg, &derived, false).await;
        assert_eq!(again.unwrap(), out, "the old location replays the output");
        let again = after_the_move::settle_payment(&calls, &msg, &derived, false).await;
        assert_eq!(again.unwrap(), out, "the new location replays the output");
    }
    assert_eq!(seen().len(), 2, "neither ran again");
    // Another name is another function: it runs, with keys of its own.
    let other = renamed_identity::settle(&calls, &msg, &derived, false)
        .await
        .unwrap();
    assert_eq!(seen().len(), 3, "another name runs");
    assert_ne!(other, out, "another name derives other keys");
}

macro_rules! on_every_store {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(&super::Memory).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(&idempotent_tests::fixtures::Sqlite::file()).await;
                }
            )*
        }
        mod postgres {
            $(
                #[cfg_attr(not(pg), ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests")]
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    use idempotent_tests::Fixture;
                    let fixture = idempotent_tests::fixtures::Postgres::new();
                    super::$case(&fixture).await;
                    fixture.cleanup().await;
                }
            )*
        }
    };
}

on_every_store!(
    runs_once_and_returns_the_output,
    errors_release_the_key,
    final_errors_are_stored,
    mismatches_and_types,
    concurrent_duplicates,
    panics_release_the_key,
    derived_keys,
    unstorable_outputs_never_run_twice,
    the_attribute_runs_once,
    message_ids_are_opaque_keys,
    every_input_is_fingerprinted,
    the_attribute_stores_final_errors_and_derives,
    the_name_is_the_identity_not_the_module_path,
);

/// Transactional mode on `$db`: the booking row commits with the stored output, or not at
/// all. `$setup` gives the calls and a pool on the same database with a fresh table `$t`.
macro_rules! transactional_cases {
    ($name:ident, $db:ty, $setup:expr, $insert:literal, $count:literal $(, #[$attr:meta])*) => {
        mod $name {
            use super::*;
            use idempotent_core::Transaction;

            async fn book(
                calls: &Calls,
                msg: &PaymentEvent,
                table: &str,
                fail: bool,
            ) -> Result<i64, CallError<BookError>> {
                let sql = format!($insert, table);
                calls
                    .run_tx::<$db, _, _, _, _>(call("book", msg), |mut tx: Transaction<$db>| async move {
                        sqlx::query(sqlx::AssertSqlSafe(sql))
                            .bind(&msg.id)
                            .bind(msg.amount)
                            .execute(&mut *tx)
                            .await
                            .map_err(|_| BookError::Unavailable)?;
                        if fail {
                            Err(BookError::Unavailable)
                        } else {
                            Ok(msg.amount)
                        }
                    })
                    .await
            }

            /// Ok commits the row with the record; redeliveries replay without writing; an
            /// error rolls the row back and releases the key.
            $(#[$attr])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_row_commits_with_the_record() {
                let (calls, pool, table, guard) = $setup.await;
                let count = || {
                    let sql = format!($count, table);
                    let pool = pool.clone();
                    async move {
                        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                            .fetch_one(&pool)
                            .await
                            .unwrap()
                    }
                };
                let msg = event(10);
                let failed = book(&calls, &msg, &table, true).await;
                assert!(matches!(failed, Err(CallError::Failed(BookError::Unavailable))));
                assert_eq!(count().await, 0, "the failed attempt's row rolled back");
                for _ in 0..3 {
                    assert_eq!(book(&calls, &msg, &table, false).await.unwrap(), 10);
                }
                assert_eq!(count().await, 1);
                guard.cleanup().await;
            }

            /// Two consumers (here eight) receive the same message at once: one books it, the
            /// others wait for its commit and return its output.
            $(#[$attr])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_consumers_book_once() {
                let (calls, pool, table, guard) = $setup.await;
                let calls = calls.concurrent(Concurrent::Wait(Duration::from_secs(5)));
                let msg = event(11);
                let tasks: Vec<_> = (0..8)
                    .map(|_| {
                        let (calls, msg, table) = (calls.clone(), msg.clone(), table.clone());
                        tokio::spawn(async move { book(&calls, &msg, &table, false).await })
                    })
                    .collect();
                for task in tasks {
                    assert_eq!(task.await.unwrap().unwrap(), 11);
                }
                let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!($count, table)))
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                assert_eq!(n, 1);
                guard.cleanup().await;
            }
        }
    };
}

/// What a transactional case leaves behind, removed when it passed.
enum Guard {
    Dir(#[allow(dead_code)] tempfile::TempDir),
    Pg(sqlx::PgPool, String, String),
}

impl Guard {
    async fn cleanup(self) {
        if let Guard::Pg(pool, records, bookings) = self {
            idempotent_tests::fixtures::pg_drop(&pool, &records).await;
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP TABLE IF EXISTS {bookings}"
            )))
            .execute(&pool)
            .await;
        }
    }
}

async fn sqlite_setup() -> (Calls, sqlx::SqlitePool, String, Guard) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("calls.db").display());
    let store = idempotent_core::SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let pool = store.pool().clone();
    // No unique constraint on `id`: a second booking of one message would show as a row.
    sqlx::raw_sql("CREATE TABLE bookings (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL, amount INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let calls = Calls::new(engine(Arc::new(store), None));
    (calls, pool, "bookings".to_owned(), Guard::Dir(dir))
}

async fn postgres_setup() -> (Calls, sqlx::PgPool, String, Guard) {
    let pool = idempotent_tests::fixtures::pg_pool(16).await;
    let records = idempotent_tests::fixtures::unique_table("calls");
    let store = idempotent_tests::fixtures::pg_store(pool.clone(), &records).await;
    let table = format!(
        "idempotent_test.{}",
        idempotent_tests::fixtures::unique_table("bookings")
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (seq bigserial PRIMARY KEY, id text NOT NULL, amount bigint NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let calls = Calls::new(engine(Arc::new(store), None));
    (
        calls,
        pool.clone(),
        table.clone(),
        Guard::Pg(pool, records, table),
    )
}

transactional_cases!(
    sqlite_transactional,
    sqlx::Sqlite,
    sqlite_setup(),
    "INSERT INTO {} (id, amount) VALUES (?1, ?2)",
    "SELECT count(*) FROM {}"
);

transactional_cases!(
    postgres_transactional,
    sqlx::Postgres,
    postgres_setup(),
    "INSERT INTO {} (id, amount) VALUES ($1, $2)",
    "SELECT count(*) FROM {}",
    #[cfg_attr(not(pg), ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests")]
);

/// A transactional call on a store that is not on that database does not run.
#[tokio::test]
async fn transactional_calls_need_the_store_on_their_database() {
    let calls = Calls::new(Engine::new(MemoryStore::new()));
    let out: Result<u8, CallError<BookError>> = calls
        .run_tx::<sqlx::Sqlite, _, _, _, _>(call("book", &event(12)), |_tx| async {
            panic!("must not run")
        })
        .await;
    assert!(matches!(out, Err(CallError::Misconfigured(_))), "{out:?}");
}

/// The lease is the engine's: a call without its own lease runs under it, and an engine lease
/// longer than the default ttl still gives calls that run (the default ttl covers it).
#[tokio::test]
async fn calls_run_under_the_engine_lease() {
    let lease = Duration::from_secs(2 * 86_400);
    let store = MemoryStore::new();
    let engine = Engine::builder(store.clone()).lease(lease).build().unwrap();
    let calls = Calls::new(engine);
    let msg = event(19);
    let runs = AtomicUsize::new(0);
    let run = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, BookError>(7_u8)
    };
    // While it runs, a duplicate is told to come back when its lease (two days) ends.
    let out = calls
        .run(call("book", &msg), || async {
            let duplicate: Result<u8, CallError<BookError>> =
                calls.run(call("book", &msg), run).await;
            match duplicate {
                Err(CallError::InProgress { retry_after }) => assert!(
                    retry_after > lease - Duration::from_secs(60) && retry_after <= lease,
                    "{retry_after:?}"
                ),
                other => panic!("{other:?}"),
            }
            run().await
        })
        .await;
    assert_eq!(out.unwrap(), 7);
    assert_eq!(calls.run(call("book", &msg), run).await.unwrap(), 7);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A call's name is its identity: the non-macro API refuses one that is empty, too long, or
/// holds characters outside `[A-Za-z0-9_.-]`, with an error rather than a panic.
#[test]
fn call_names_are_validated() {
    let msg = event(18);
    let make = |name: &'static str| {
        Call::new(
            name,
            Scope::new(&msg.tenant).unwrap(),
            IdempotencyKey::opaque(msg.id.as_str()).unwrap(),
            &msg,
        )
    };
    let long: &'static str = "x".repeat(65).leak();
    for bad in [
        "",
        "book payment",
        "payments::book",
        "réserver",
        "a\nb",
        long,
    ] {
        let out = make(bad);
        assert!(
            matches!(out, Err(InvalidCall::Name(_))),
            "{bad:?} must be refused: {out:?}"
        );
    }
    let longest: &'static str = "x".repeat(64).leak();
    for good in ["book_payment", "payments.book-v2", "A1", longest] {
        let out = make(good);
        assert!(out.is_ok(), "{good:?} is a valid name: {out:?}");
    }
}

/// Review of issue 49: a function's output has no limit to reserve, so a consumer's messages
/// of one tenant in flight are not bounded by a route's 1 MiB reservation each: 100 at once
/// on the memory store all run (with 1 MiB reserved each, 31 did and the rest were refused
/// for the tenant's 32 MiB budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_messages_in_flight_are_not_bounded_by_reservations() {
    let calls = calls(&Memory).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(100));
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let (calls, barrier) = (calls.clone(), barrier.clone());
            tokio::spawn(async move {
                let msg = event(1);
                barrier.wait().await;
                calls
                    .run(call("book", &msg), || async {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        Ok::<_, BookError>(Receipt { booked: 1, run: 1 })
                    })
                    .await
            })
        })
        .collect();
    for t in tasks {
        let out = t.await.unwrap();
        assert!(out.is_ok(), "{out:?}");
    }
}
