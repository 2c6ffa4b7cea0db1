//! SQL-store behaviour beyond the conformance suite: round trips, no writes on replay,
//! races across instances and processes, the database clock, and killed connections.
//!
//! This file holds the shared helpers (a request, a handled response, the round-trip count,
//! a warm-up execution, a PostgreSQL error's SQLSTATE); the cases live in topic modules:
//! `round_trips`, `races`, `clocks`, `row_locks`, `stalls` (connections gone silent, through a
//! proxy), `failures` (held locks, killed connections, unreachable databases, refused names)
//! and `mysql` (MySQL's session settings, quoting and sweeper batches).
#![allow(clippy::unwrap_used)] // tests unwrap freely

mod clocks;
mod failures;
mod mysql;
mod races;
mod round_trips;
mod row_locks;
mod stalls;

use idempotent_core::{engine::*, store::*, tx::*, *};
use idempotent_tests::conformance::{fp, unique_key};
use idempotent_tests::execute::{Execute, Handled, Outcome};
use idempotent_tests::fixtures::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const PG_ONLY: &str = "set DATABASE_URL=postgres://… to run the PostgreSQL tests";

fn request(key: &RecordKey) -> ExecuteRequest {
    ExecuteRequest {
        scope: key.scope.clone(),
        key: Ok(key.key.clone()),
        fingerprint: fp("rt"),
    }
}

fn handled() -> Handled<()> {
    Handled {
        value: (),
        record: StoredResponse::new(201, "ok").into(),
    }
}

/// An engine without the sweeper every engine starts with its first request (the sweeper's
/// deletes would be counted with the statements a request sends).
fn unswept(store: impl Store) -> Engine {
    Engine::builder(store).no_sweeper().build().unwrap()
}

/// First execution: claim + complete; replay: one statement. Counted at the store.
async fn round_trips(engine: &Engine, sent: impl Fn() -> u64, first_cost: u64) {
    let key = unique_key("rt");
    let before = sent();
    let out = engine
        .execute(request(&key), &Policy::default(), || async { handled() })
        .await;
    assert!(
        matches!(
            out,
            Outcome::Executed {
                recorded: Recorded::Stored,
                ..
            }
        ),
        "{out:?}"
    );
    assert_eq!(
        sent() - before,
        first_cost,
        "statements for a first execution"
    );
    for _ in 0..3 {
        let before = sent();
        let out = engine
            .execute(request(&key), &Policy::default(), || async { handled() })
            .await;
        assert!(matches!(out, Outcome::Replayed(_)), "{out:?}");
        assert_eq!(sent() - before, 1, "statements for a replay");
    }
}

/// The SQLSTATE of a store error that came from PostgreSQL.
fn sqlstate(error: &StoreError) -> Option<String> {
    let StoreError::Unavailable(source) = error else {
        return None;
    };
    let db = source.downcast_ref::<sqlx::Error>()?.as_database_error()?;
    db.code().map(|c| c.into_owned())
}

/// One execution, so that what a store does once (MySQL: whether its sessions autocommit)
/// is not counted against the executions measured after it.
async fn warm_up(engine: &Engine) {
    let out = engine
        .execute(request(&unique_key("warm")), &Policy::default(), || async {
            handled()
        })
        .await;
    assert!(matches!(out, Outcome::Executed { .. }), "{out:?}");
}
