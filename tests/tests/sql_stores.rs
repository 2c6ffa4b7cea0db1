//! SQL-store behaviour beyond the conformance suite: round trips, no writes on replay,
//! races across instances and processes, the database clock, and killed connections.
#![allow(clippy::unwrap_used)] // tests unwrap freely

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

#[tokio::test]
async fn sqlite_round_trips() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let engine = Engine::new(store.clone());
    // SQLite: read (miss) + INSERT … RETURNING + complete; replays are the read alone.
    round_trips(&engine, || store.statements_sent(), 3).await;
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_round_trips_and_no_write_on_replay() {
    let _ = PG_ONLY;
    let pool = pg_pool(4).await;
    let table = unique_table("rt");
    let store = pg_store(pool.clone(), &table).await;
    let engine = Engine::new(store.clone());
    round_trips(&engine, || store.statements_sent(), 2).await;

    // A replay must not lock or rewrite the row: `ON CONFLICT DO UPDATE … WHERE false` would
    // stamp the row's xmax with the replaying transaction; our statement leaves it at 0.
    let key = unique_key("xmax");
    engine
        .execute(request(&key), &Policy::default(), || async { handled() })
        .await;
    let (xmin_before, _) = row_versions(&pool, &table, &key).await;
    for _ in 0..5 {
        let out = engine
            .execute(request(&key), &Policy::default(), || async { handled() })
            .await;
        assert!(matches!(out, Outcome::Replayed(_)));
    }
    let (xmin, xmax) = row_versions(&pool, &table, &key).await;
    assert_eq!(
        (xmin, xmax.as_str()),
        (xmin_before, "0"),
        "replays wrote to the row"
    );
    pg_drop(&pool, &table).await;
}

/// The row's `xmin` and `xmax` (which transactions wrote and locked it).
async fn row_versions(pool: &sqlx::PgPool, table: &str, key: &RecordKey) -> (String, String) {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT xmin::text, xmax::text FROM idempotent_test.{table} WHERE scope = $1 AND key = $2"
    )))
    .bind(key.scope.as_str())
    .bind(key.key.as_str())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Runs `keys` × `dups` claims spread over `stores` (one per instance), all concurrently per
/// key; returns key → outcomes.
async fn race(
    stores: Vec<Arc<dyn Store>>,
    keys: usize,
    dups: usize,
) -> HashMap<usize, Vec<String>> {
    let scope = Scope::new(format!("race-{}", uuid::Uuid::new_v4())).unwrap();
    let mut seen: HashMap<usize, Vec<String>> = HashMap::new();
    for chunk in (0..keys).collect::<Vec<_>>().chunks(50) {
        let mut tasks = Vec::new();
        for &k in chunk {
            for d in 0..dups {
                let store = Arc::clone(&stores[d % stores.len()]);
                let scope = scope.clone();
                let instance = d % stores.len();
                tasks.push(tokio::spawn(async move {
                    let key = RecordKey::new(
                        scope,
                        IdempotencyKey::parse(format!("k{k}").as_bytes()).unwrap(),
                    );
                    let req = ClaimRequest {
                        key: &key,
                        fingerprint: &fp("race"),
                        lease: Duration::from_secs(60),
                        ttl: Duration::from_secs(3600),
                        max_stored: 0,
                    };
                    let seen = match store.claim(req).await.unwrap() {
                        ClaimOutcome::Claimed(lease) => {
                            let body = format!("instance{instance}:{k}");
                            store
                                .complete(
                                    &key,
                                    lease.token,
                                    &StoredResponse::new(201, body.clone()).into(),
                                    req.ttl,
                                )
                                .await
                                .unwrap();
                            format!("claimed {body}")
                        }
                        ClaimOutcome::Replay(StoredOutcome::Response(r)) => {
                            format!("replay {}", String::from_utf8(r.body).unwrap())
                        }
                        ClaimOutcome::InProgress { .. } => "busy".to_owned(),
                        other => panic!("unexpected {other:?}"),
                    };
                    (k, seen)
                }));
            }
        }
        for t in tasks {
            let (k, s) = t.await.unwrap();
            seen.entry(k).or_default().push(s);
        }
    }
    seen
}

/// Exactly one claim per key; every loser saw the winner's record (in progress, or its body).
fn assert_one_winner_each(seen: &HashMap<usize, Vec<String>>, keys: usize, dups: usize) {
    assert_eq!(seen.len(), keys);
    let mut claims = 0;
    for (k, outcomes) in seen {
        assert_eq!(outcomes.len(), dups, "key {k}");
        let winners: Vec<&String> = outcomes
            .iter()
            .filter(|o| o.starts_with("claimed "))
            .collect();
        assert_eq!(winners.len(), 1, "key {k}: {outcomes:?}");
        claims += 1;
        let body = winners[0].trim_start_matches("claimed ");
        for o in outcomes {
            assert!(
                o == "busy" || o == winners[0] || o.trim_start_matches("replay ") == body,
                "key {k}: a loser saw something else: {outcomes:?}"
            );
        }
    }
    assert_eq!(claims, keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_two_pools_race_one_winner_per_key() {
    let table = unique_table("race");
    let a = pg_store(pg_pool(8).await, &table).await;
    let b = idempotent_core::PostgresStore::builder(pg_pool(8).await)
        .schema("idempotent_test")
        .table(&table)
        .build()
        .unwrap();
    b.migrate().await.unwrap(); // a second instance migrating the same table is a no-op
    let seen = race(vec![Arc::new(a.clone()), Arc::new(b)], 1000, 8).await;
    assert_one_winner_each(&seen, 1000, 8);
    let done: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM idempotent_test.{table} WHERE done"
    )))
    .fetch_one(a.pool())
    .await
    .unwrap();
    assert_eq!(done, 1000);
    pg_drop(a.pool(), &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_two_pools_race_one_winner_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("race.db").display());
    let a = SqliteStore::connect(&url).await.unwrap();
    a.migrate().await.unwrap();
    let b = SqliteStore::connect(&url).await.unwrap();
    b.migrate().await.unwrap();
    let seen = race(vec![Arc::new(a), Arc::new(b)], 1000, 8).await;
    assert_one_winner_each(&seen, 1000, 8);
}

/// Three instances starting together on a new file migrate it at once, and all succeed: one
/// applies the migration, and one that lost the race (the versions table refused its second
/// insert of version 1) runs again and finds it applied. sqlx's SQLite migrator takes no
/// lock of its own: before, a loser failed with "UNIQUE constraint failed:
/// <table>_migrations.version" (the first new file did, on the machine where it was seen).
/// Twenty new files, each a fresh race; then each store claims a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_instances_migrate_a_new_file_at_once() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..20 {
        let file = dir.path().join(format!("new-{round}.db"));
        let url = format!("sqlite://{}", file.display());
        let a = SqliteStore::connect(&url).await.unwrap();
        let b = SqliteStore::connect(&url).await.unwrap();
        let c = SqliteStore::connect(&url).await.unwrap();
        let (ma, mb, mc) = tokio::join!(a.migrate(), b.migrate(), c.migrate());
        for (name, migrated) in [("a", ma), ("b", mb), ("c", mc)] {
            if let Err(e) = migrated {
                panic!("round {round}, {name}: {e}");
            }
        }
        for (store, name) in [(&a, "a"), (&b, "b"), (&c, "c")] {
            let key = RecordKey::new(
                Scope::new("s").unwrap(),
                IdempotencyKey::parse(name.as_bytes()).unwrap(),
            );
            let req = ClaimRequest {
                key: &key,
                fingerprint: &fp("migrated"),
                lease: Duration::from_secs(60),
                ttl: Duration::from_secs(3600),
                max_stored: 0,
            };
            let outcome = store.claim(req).await.unwrap();
            assert!(matches!(outcome, ClaimOutcome::Claimed(_)), "{outcome:?}");
        }
    }
}

#[test]
fn sqlite_two_processes_race_one_winner_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("procs.db").display());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = SqliteStore::connect(&url).await.unwrap();
        store.migrate().await.unwrap();
    });
    let start = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
        + 700;
    let racers: Vec<_> = ["p1", "p2"]
        .iter()
        .map(|label| {
            std::process::Command::new(env!("CARGO_BIN_EXE_sqlite_racer"))
                .args([&url, "1000", "4", label, &start.to_string()])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut seen: HashMap<usize, Vec<String>> = HashMap::new();
    for racer in racers {
        let out = racer.wait_with_output().unwrap();
        assert!(out.status.success());
        for line in String::from_utf8(out.stdout).unwrap().lines() {
            let mut parts = line.splitn(3, '\t');
            let (k, kind, detail) = (
                parts.next().unwrap(),
                parts.next().unwrap(),
                parts.next().unwrap(),
            );
            let entry = match kind {
                "claimed" => format!("claimed {detail}"),
                "replay" => format!("replay {detail}"),
                "busy" => "busy".to_owned(),
                _ => panic!("racer reported: {line}"),
            };
            seen.entry(k.parse().unwrap()).or_default().push(entry);
        }
    }
    assert_one_winner_each(&seen, 1000, 8);
    // Both processes won some keys: they really raced.
    let p1 = seen
        .values()
        .flatten()
        .filter(|o| o.starts_with("claimed p1:"))
        .count();
    assert!(p1 > 0 && p1 < 1000, "p1 won {p1} of 1000");
}

fn epoch_ms(t: SystemTime) -> i64 {
    i64::try_from(t.duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// Two instances `a` and `b` on a database whose clock runs an hour ahead of this process's
/// (`db_now`, read from it): `a`'s claim stamps its lease end and expiry in database time,
/// and `b` compares in database time too (busy for at most the lease). Returns the key `a`
/// holds, its lease and its token.
async fn leases_in_database_time(
    a: &dyn Store,
    b: &dyn Store,
    db_now: i64,
) -> (RecordKey, Duration, LeaseToken) {
    let local_now = epoch_ms(SystemTime::now());
    assert!(
        (db_now - local_now - 3_600_000).abs() < 60_000,
        "the skew is in place: db {db_now} vs local {local_now}"
    );
    let key = unique_key("clock");
    let lease = Duration::from_millis(1500);
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("c"),
        lease,
        ttl: Duration::from_secs(60),
        max_stored: 0,
    };
    let ClaimOutcome::Claimed(l) = a.claim(req).await.unwrap() else {
        panic!("not claimed")
    };
    let until = epoch_ms(l.locked_until);
    assert!(
        (until - (db_now + 1500)).abs() < 1000,
        "lease end {until} is stamped in database time ({db_now} + 1500), not local time ({local_now} + 1500)"
    );
    let record = b.get(&key).await.unwrap().expect("record");
    assert!((epoch_ms(record.expires_at) - (db_now + 61_500)).abs() < 1000);
    match b.claim(req).await.unwrap() {
        ClaimOutcome::InProgress { retry_after } => assert!(retry_after <= lease),
        other => panic!("{other:?}"),
    }
    (key, lease, l.token)
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_leases_follow_the_database_clock() {
    // Skew the database clock for real, as the store sees it: a schema whose
    // `statement_timestamp()` and `now()` run an hour ahead, first on the search path of the
    // store's connections (PostgreSQL resolves unqualified functions through the search path
    // when `pg_catalog` is listed after it). If leases were stamped or compared with this
    // process's clock, they would be an hour off.
    let skew = unique_table("skew");
    let admin = pg_pool(1).await;
    for fun in ["statement_timestamp", "now", "clock_timestamp"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {skew};
             CREATE FUNCTION {skew}.{fun}() RETURNS timestamptz LANGUAGE sql STABLE
                 AS $$ SELECT pg_catalog.{fun}() + interval '1 hour' $$;"
        )))
        .execute(&admin)
        .await
        .unwrap();
    }
    let skewed = || async {
        let options: sqlx::postgres::PgConnectOptions = database_url().parse().unwrap();
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .test_before_acquire(false)
            .connect_with(options.options([("search_path", format!("{skew},pg_catalog,public"))]))
            .await
            .unwrap()
    };
    // Two instances (pools) on the skewed database.
    let table = unique_table("clock");
    let a = pg_store(skewed().await, &table).await;
    let b = pg_store(skewed().await, &table).await;
    let db_now: i64 =
        sqlx::query_scalar("SELECT (extract(epoch FROM statement_timestamp()) * 1000)::int8")
            .fetch_one(a.pool())
            .await
            .unwrap();
    let (key, lease, _) = leases_in_database_time(&a, &b, db_now).await;
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("c"),
        lease,
        ttl: Duration::from_secs(60),
        max_stored: 0,
    };
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    assert!(matches!(
        b.claim(req).await.unwrap(),
        ClaimOutcome::Claimed(Lease {
            took_over: true,
            ..
        })
    ));
    pg_drop(a.pool(), &table).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {skew} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}

/// A `complete` that meets SQLite's write lock held past the busy timeout fails; the engine
/// retries it within the lease, and stores the outcome once the lock is gone. If the lock
/// outlasts the retries, the record stays in progress: a retry gets "in progress", never a
/// second execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_complete_waits_out_a_held_write_lock() {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("locked.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_millis(100));
    let pool = SqlitePoolOptions::new()
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .unwrap();
    let store = SqliteStore::builder(pool.clone()).build().unwrap();
    store.migrate().await.unwrap();
    let engine = Engine::new(store.clone());
    let outcome = || StoredOutcome::from(StoredResponse::new(201, "ok"));

    for (lease_ms, hold_ms, stored) in [(4000, 600, true), (600, 2000, false)] {
        let policy = Policy {
            lease: Duration::from_millis(lease_ms),
            ..Policy::default()
        };
        let key = unique_key("locked");
        let Begin::Claimed(execution) = engine.begin(request(&key), &policy).await else {
            panic!("not claimed")
        };
        // Another writer takes the database's write lock and holds it.
        let mut blocker = pool.acquire().await.unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *blocker)
            .await
            .unwrap();
        let holder = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(hold_ms)).await;
            sqlx::query("COMMIT").execute(&mut *blocker).await.unwrap();
        });
        let recorded = execution.finish(outcome()).await;
        if stored {
            assert!(matches!(recorded, Recorded::Stored), "{recorded:?}");
            assert!(matches!(
                engine.begin(request(&key), &policy).await,
                Begin::Replay(_)
            ));
        } else {
            assert!(
                matches!(recorded, Recorded::Failed(StoreError::Unavailable(_))),
                "{recorded:?}"
            );
            // Readers are not blocked in WAL mode: the retry sees the attempt in progress.
            assert!(matches!(
                engine.begin(request(&key), &policy).await,
                Begin::InProgress { .. }
            ));
        }
        holder.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_killed_connection_mid_claim_is_unavailable_not_a_duplicate() {
    let table = unique_table("kill");
    let pool = pg_pool(1).await; // one connection, so we know its backend pid
    let store = pg_store(pool.clone(), &table).await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();

    // Another session inserts the same key and holds its transaction open, so our claim's
    // INSERT … ON CONFLICT waits on the unique index: the claim is in flight.
    let key = unique_key("kill");
    let other = pg_pool(2).await;
    let mut blocker = other.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO idempotent_test.{table} (scope, key, fingerprint, token, locked_until, expires_at)
         VALUES ($1, $2, $3, gen_random_uuid(), now() + interval '1 minute', now() + interval '1 hour')"
    )))
    .bind(key.scope.as_str())
    .bind(key.key.as_str())
    .bind(fp("k").to_stored().to_vec())
    .execute(&mut *blocker)
    .await
    .unwrap();
    let claim = {
        let (store, key) = (store.clone(), key.clone());
        tokio::spawn(async move {
            store
                .claim(ClaimRequest {
                    key: &key,
                    fingerprint: &fp("k"),
                    lease: Duration::from_secs(30),
                    ttl: Duration::from_secs(60),
                    max_stored: 0,
                })
                .await
        })
    };
    // Wait until the claim is waiting on the lock, then kill its backend.
    for _ in 0..100 {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_optional(&other)
                .await
                .unwrap()
                .flatten();
        if waiting.as_deref() == Some("Lock") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&other)
        .await
        .unwrap();
    assert!(killed);
    let result = claim.await.unwrap();
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "{result:?}"
    );
    blocker.rollback().await.unwrap();

    // The pool reconnects; exactly one claim now wins and nothing was left behind.
    let again = store
        .claim(ClaimRequest {
            key: &key,
            fingerprint: &fp("k"),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            max_stored: 0,
        })
        .await
        .unwrap();
    assert!(
        matches!(
            again,
            ClaimOutcome::Claimed(Lease {
                took_over: false,
                ..
            })
        ),
        "{again:?}"
    );
    let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM idempotent_test.{table}"
    )))
    .fetch_one(&other)
    .await
    .unwrap();
    assert_eq!(rows, 1);
    pg_drop(&other, &table).await;
}

#[tokio::test]
async fn unreachable_database_is_unavailable() {
    // A PostgreSQL port nothing listens on; the pool times out fast.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/none")
        .unwrap();
    let store = PostgresStore::new(pool).unwrap();
    let engine = Engine::new(store);
    let key = unique_key("down");
    let out = engine
        .execute(request(&key), &Policy::default(), || async { handled() })
        .await;
    assert!(
        matches!(out, Outcome::StoreUnavailable(StoreError::Unavailable(_))),
        "{out:?}"
    );
}

#[tokio::test]
async fn invalid_table_names_are_refused() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    let bad = SqliteStore::builder(store.pool().clone())
        .table("x; DROP TABLE y")
        .build();
    assert!(matches!(bad, Err(SetupError::InvalidIdentifier(_))));
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_complete_is_a_hot_update() {
    // One connection, so the statistics we flush are the ones our statements produced.
    let pool = pg_pool(1).await;
    let table = unique_table("hot");
    let store = pg_store(pool.clone(), &table).await;
    let engine = Engine::new(store);
    for _ in 0..50 {
        let key = unique_key("hot");
        let out = engine
            .execute(request(&key), &Policy::default(), || async { handled() })
            .await;
        assert!(matches!(
            out,
            Outcome::Executed {
                recorded: Recorded::Stored,
                ..
            }
        ));
    }
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&pool)
        .await
        .unwrap();
    let mut counts = (0_i64, 0_i64);
    for _ in 0..50 {
        counts = sqlx::query_as(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE schemaname = 'idempotent_test' AND relname = $1",
        )
        .bind(&table)
        .fetch_one(&pool)
        .await
        .unwrap();
        if counts.0 >= 50 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (updates, hot) = counts;
    assert_eq!(updates, 50, "one complete per execution");
    assert!(
        hot >= 45,
        "completes should be HOT updates: {hot} of {updates}"
    );
    pg_drop(&pool, &table).await;
}

/// A pool whose sessions default to `level` (a server configured that way).
async fn pg_pool_at(level: &'static str, max: u32) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(false)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                let set = format!("SET default_transaction_isolation = '{level}'");
                sqlx::raw_sql(sqlx::AssertSqlSafe(set))
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .connect(&database_url())
        .await
        .unwrap()
}

/// Plain mode on a server whose default isolation is SERIALIZABLE (or REPEATABLE READ):
/// concurrent duplicates still get one winner and 409s or replays, never a 503 for a
/// serialization failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_stricter_default_isolation_still_one_winner_per_key() {
    for level in ["serializable", "repeatable read"] {
        let table = unique_table("iso");
        let a = pg_store(pg_pool_at(level, 8).await, &table).await;
        let b = idempotent_core::PostgresStore::builder(pg_pool_at(level, 8).await)
            .schema("idempotent_test")
            .table(&table)
            .build()
            .unwrap();
        let seen = race(vec![Arc::new(a.clone()), Arc::new(b)], 300, 8).await;
        assert_one_winner_each(&seen, 300, 8);
        pg_drop(a.pool(), &table).await;
    }
}

/// A take-over never waits on the record's row lock (held here by another transaction, as an
/// owner between its complete and its COMMIT holds it): plain mode and single commit answer
/// in progress at once (PostgreSQL: `FOR UPDATE NOWAIT` in the take-over; MySQL: the same in
/// a short transaction, where an `UPDATE` would wait `innodb_lock_wait_timeout`, 50 s); once
/// the lock goes, the take-over runs. `lock_sql` locks the row of (scope, key).
async fn take_over_never_waits_on_a_row_lock<DB>(
    store: DB::Store,
    pool: &sqlx::Pool<DB>,
    lock_sql: String,
) where
    DB: TxDatabase,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let key = unique_key("locked");
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("rt"),
        lease: Duration::from_millis(200),
        ttl: Duration::from_secs(3600),
        max_stored: 0,
    };
    assert!(matches!(
        store.claim(req).await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    tokio::time::sleep(Duration::from_millis(400)).await; // the lease ends
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(lock_sql))
        .bind(key.scope.as_str())
        .bind(key.key.as_str())
        .execute(&mut *holder)
        .await
        .unwrap();
    let second = Duration::from_secs(1);
    let plain = tokio::time::timeout(second, store.claim(req))
        .await
        .expect("plain mode's take-over waited on the row lock");
    assert!(
        matches!(plain, Ok(ClaimOutcome::InProgress { retry_after }) if retry_after > Duration::ZERO),
        "{plain:?}"
    );
    let engine = Engine::new(store.clone());
    let policy = Policy {
        lease: Duration::from_millis(200),
        ..Policy::default()
    };
    let single = TxOptions {
        commit: CommitPath::Single,
        wait: Duration::from_millis(50),
        max_waiters: 4,
        read_first: true,
    };
    let begin = tokio::time::timeout(
        second,
        engine.begin_transactional::<DB>(request(&key), &policy, &single),
    )
    .await
    .expect("single commit's take-over waited on the row lock");
    assert!(
        matches!(begin, TxBegin::Respond(Begin::InProgress { .. })),
        "{begin:?}"
    );
    holder.rollback().await.unwrap();
    assert!(matches!(
        store.claim(req).await.unwrap(),
        ClaimOutcome::Claimed(lease) if lease.took_over
    ));
}

/// A heartbeat never waits on the record's row lock either (held here by another
/// transaction, as the owner's own complete holds it on the two-commit path until its COMMIT):
/// it is answered unavailable at once, so it holds no pooled connection and cannot extend a
/// lease after its owner gave up; once the lock goes, it extends. `lock_sql` locks the row of
/// (scope, key).
async fn extend_never_waits_on_a_row_lock<DB>(
    store: DB::Store,
    pool: &sqlx::Pool<DB>,
    lock_sql: String,
    lock_not_granted: fn(&StoreError) -> bool,
) where
    DB: TxDatabase,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let key = unique_key("locked-extend");
    let lease = Duration::from_secs(60);
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("rt"),
        lease,
        ttl: Duration::from_secs(3600),
        max_stored: 0,
    };
    let ClaimOutcome::Claimed(claimed) = store.claim(req).await.unwrap() else {
        panic!("not claimed")
    };
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(lock_sql.clone()))
        .bind(key.scope.as_str())
        .bind(key.key.as_str())
        .execute(&mut *holder)
        .await
        .unwrap();
    let extended = tokio::time::timeout(
        Duration::from_secs(2),
        store.extend(&key, claimed.token, lease),
    )
    .await
    .expect("the heartbeat waited on the row lock");
    assert!(
        extended.as_ref().is_err_and(lock_not_granted),
        "{extended:?}"
    );
    holder.rollback().await.unwrap();
    let until = store.extend(&key, claimed.token, lease).await.unwrap();
    assert!(until > SystemTime::now() + lease / 2, "{until:?}");
    // The heartbeat left no lock behind: another transaction takes the row without waiting.
    let mut after = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("{lock_sql} NOWAIT")))
        .bind(key.scope.as_str())
        .bind(key.key.as_str())
        .execute(&mut *after)
        .await
        .expect("the heartbeat left the row locked");
    after.rollback().await.unwrap();
    // Still fenced: a token that does not hold the record extends nothing.
    assert!(matches!(
        store.extend(&key, LeaseToken::generate(), lease).await,
        Err(StoreError::StaleLease)
    ));
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_extend_never_waits_on_a_row_lock() {
    let table = unique_table("nowait");
    let pool = pg_pool(4).await;
    let store = pg_store(pool.clone(), &table).await;
    let sql =
        format!("SELECT 1 FROM idempotent_test.{table} WHERE scope = $1 AND key = $2 FOR UPDATE");
    extend_never_waits_on_a_row_lock::<sqlx::Postgres>(store, &pool, sql, |e| {
        sqlstate(e).as_deref() == Some("55P03")
    })
    .await;
    pg_drop(&pool, &table).await;
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_take_over_never_waits_on_a_row_lock() {
    let table = unique_table("nowait");
    let pool = pg_pool(4).await;
    let store = pg_store(pool.clone(), &table).await;
    let sql =
        format!("SELECT 1 FROM idempotent_test.{table} WHERE scope = $1 AND key = $2 FOR UPDATE");
    take_over_never_waits_on_a_row_lock::<sqlx::Postgres>(store, &pool, sql).await;
    pg_drop(&pool, &table).await;
}

/// The SQLSTATE of a store error that came from PostgreSQL.
fn sqlstate(error: &StoreError) -> Option<String> {
    let StoreError::Unavailable(source) = error else {
        return None;
    };
    let db = source.downcast_ref::<sqlx::Error>()?.as_database_error()?;
    db.code().map(|c| c.into_owned())
}

/// `claim_on` inside a transaction of the caller's: a serialization failure is the caller's to
/// see (40001, so it can run its transaction again), never an error of the store's own making,
/// and it does not change how the store claims later, in or out of a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_claim_on_inside_a_callers_transaction() {
    use sqlx::Connection;
    let table = unique_table("callertx");
    let pool = pg_pool(4).await;
    let store = pg_store(pool.clone(), &table).await;
    let key = unique_key("k");
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("rt"),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        max_stored: 0,
    };
    let serializable = "BEGIN ISOLATION LEVEL SERIALIZABLE";
    // The first claims in its transaction; the second took its snapshot before that commits.
    let mut first = pool.acquire().await.unwrap();
    let mut tx1 = first.begin_with(serializable).await.unwrap();
    assert!(matches!(
        store.claim_on(&mut tx1, req).await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    let mut second = pool.acquire().await.unwrap();
    let second_claim = {
        let store = store.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let mut tx2 = second.begin_with(serializable).await.unwrap();
            sqlx::query("SELECT 1").execute(&mut *tx2).await.unwrap();
            let req = ClaimRequest {
                key: &key,
                fingerprint: &fp("rt"),
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(3600),
                max_stored: 0,
            };
            let out = store.claim_on(&mut tx2, req).await;
            drop(tx2);
            out
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await; // the second waits on the row
    tx1.commit().await.unwrap();
    let out = second_claim.await.unwrap();
    match &out {
        Err(e) => assert_eq!(sqlstate(e).as_deref(), Some("40001"), "{e:?}"),
        other => panic!("expected the caller's serialization failure: {other:?}"),
    }
    // Claims go on as before: inside a READ COMMITTED transaction of the caller's, and alone.
    let fresh = unique_key("after");
    let fresh_req = ClaimRequest { key: &fresh, ..req };
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
        .unwrap();
    let inside = store.claim_on(&mut tx, fresh_req).await;
    assert!(matches!(inside, Ok(ClaimOutcome::Claimed(_))), "{inside:?}");
    tx.commit().await.unwrap();
    let before = store.statements_sent();
    let lone = unique_key("alone");
    let alone = store.claim(ClaimRequest { key: &lone, ..req });
    assert!(matches!(alone.await, Ok(ClaimOutcome::Claimed(_))));
    assert_eq!(
        store.statements_sent() - before,
        1,
        "a claim alone is one statement"
    );
    pg_drop(&pool, &table).await;
}

// MySQL / MariaDB (`MYSQL_URL`).

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

/// Plain mode: a first execution is three statements (the read that misses, the `INSERT`
/// that claims, the `UPDATE` that completes) and a replay one; a replay takes no lock: it
/// answers while another transaction holds the record's row locked (a locking read or a
/// write would wait for it).
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_round_trips_and_no_lock_on_replay() {
    let pool = mysql_pool(4).await;
    let table = unique_table("rt");
    let store = mysql_store(pool.clone(), &table).await;
    let engine = Engine::new(store.clone());
    warm_up(&engine).await;
    round_trips(&engine, || store.statements_sent(), 3).await;

    let key = unique_key("locked");
    engine
        .execute(request(&key), &Policy::default(), || async { handled() })
        .await;
    let mut locker = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE"
    )))
    .bind(key.scope.as_str())
    .bind(key.key.as_str())
    .fetch_one(&mut *locker)
    .await
    .unwrap();
    for _ in 0..3 {
        let out = tokio::time::timeout(
            Duration::from_secs(5),
            engine.execute(request(&key), &Policy::default(), || async { handled() }),
        )
        .await
        .expect("a replay waited for the row's lock");
        assert!(matches!(out, Outcome::Replayed(_)), "{out:?}");
    }
    locker.rollback().await.unwrap();
    mysql_drop(&pool, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_two_pools_race_one_winner_per_key() {
    let table = unique_table("race");
    let a = mysql_store(mysql_pool(8).await, &table).await;
    let b = idempotent_core::MySqlStore::builder(mysql_pool(8).await)
        .table(&table)
        .build()
        .unwrap();
    b.migrate().await.unwrap(); // a second instance migrating the same table is a no-op
    let seen = race(vec![Arc::new(a.clone()), Arc::new(b)], 1000, 8).await;
    assert_one_winner_each(&seen, 1000, 8);
    let done: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE done"
    )))
    .fetch_one(a.pool())
    .await
    .unwrap();
    assert_eq!(done, 1000);
    mysql_drop(a.pool(), &table).await;
}

/// Leases are stamped and compared in the database's time: two instances whose sessions run
/// an hour ahead (the session's `timestamp`, which `UTC_TIMESTAMP()` follows; it also stops
/// that clock, so no expiry is waited for here) stamp the lease an hour ahead of this
/// process and see each other's claim in progress.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_leases_follow_the_database_clock() {
    let skewed = || async {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(2)
            .test_before_acquire(false)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::raw_sql("SET SESSION timestamp = UNIX_TIMESTAMP(NOW(6)) + 3600")
                        .execute(conn)
                        .await
                        .map(|_| ())
                })
            })
            .connect(&mysql_url())
            .await
            .unwrap()
    };
    let table = unique_table("clock");
    let a = mysql_store(skewed().await, &table).await;
    let b = idempotent_core::MySqlStore::builder(skewed().await)
        .table(&table)
        .build()
        .unwrap();
    let db_now: i64 = sqlx::query_scalar(
        "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000",
    )
    .fetch_one(a.pool())
    .await
    .unwrap();
    let (key, lease, token) = leases_in_database_time(&a, &b, db_now).await;
    // A heartbeat from the other instance's clock: the new end, in database time too.
    let until = b.extend(&key, token, lease).await.unwrap();
    assert!((epoch_ms(until) - (db_now + 1500)).abs() < 1000);
    mysql_drop(a.pool(), &table).await;
}

#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_take_over_never_waits_on_a_row_lock() {
    let table = unique_table("nowait");
    let pool = mysql_pool(4).await;
    let store = mysql_store(pool.clone(), &table).await;
    let sql = format!("SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE");
    take_over_never_waits_on_a_row_lock::<sqlx::MySql>(store, &pool, sql).await;
    mysql_drop(&pool, &table).await;
}

#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_extend_never_waits_on_a_row_lock() {
    let table = unique_table("nowait");
    let pool = mysql_pool(4).await;
    let store = mysql_store(pool.clone(), &table).await;
    let sql = format!("SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE");
    extend_never_waits_on_a_row_lock::<sqlx::MySql>(store, &pool, sql, |e| {
        mysql_error_number(e).is_some_and(|n| n == 1205 || n == 3572)
    })
    .await;
    mysql_drop(&pool, &table).await;
}

/// A session frozen inside a heartbeat's transaction while it holds the record's row lock
/// (its COMMIT never reaches the server: a stopped process, a lost network) is ended by the
/// server within the store's 10 s idle limit, and the lock goes with it. With the server's
/// default idle limit (8 hours) the row would stay locked: the owner's complete would wait
/// `innodb_lock_wait_timeout` (50 s) and fail, again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_a_heartbeat_frozen_holding_the_row_lock_is_ended_by_the_server() {
    use idempotent_tests::stall::StallingProxy;
    let table = unique_table("frozen");
    let pool = mysql_pool(2).await;
    let store = mysql_store(pool.clone(), &table).await;
    let proxy = StallingProxy::start("127.0.0.1:3306".parse().unwrap()).await;
    let url = mysql_url().replace("127.0.0.1:3306", &proxy.addr().to_string());
    assert_ne!(url, mysql_url(), "MYSQL_URL must name 127.0.0.1:3306");
    let frozen = MySqlStore::builder(
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect(&url)
            .await
            .unwrap(),
    )
    .table(&table)
    .build()
    .unwrap();
    let key = unique_key("frozen");
    let lease = Duration::from_secs(60);
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("rt"),
        lease,
        ttl: Duration::from_secs(3600),
        max_stored: 0,
    };
    let ClaimOutcome::Claimed(claimed) = store.claim(req).await.unwrap() else {
        panic!("not claimed")
    };
    proxy.arm_on(b"COMMIT; SET SESSION wait_timeout");
    let stuck = {
        let key = key.clone();
        tokio::spawn(async move { frozen.extend(&key, claimed.token, lease).await })
    };
    let armed = std::time::Instant::now();
    while proxy.stalled() == 0 {
        assert!(
            armed.elapsed() < Duration::from_secs(10),
            "the heartbeat's COMMIT never passed the proxy"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = std::time::Instant::now();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE"
    )))
    .bind(key.scope.as_str())
    .bind(key.key.as_str())
    .execute(&mut *tx)
    .await
    .expect("the frozen session kept the row locked until innodb_lock_wait_timeout");
    let waited = started.elapsed();
    tx.rollback().await.unwrap();
    assert!(
        waited > Duration::from_secs(2),
        "the row was not locked by the frozen heartbeat (waited {waited:?})"
    );
    assert!(
        waited < Duration::from_secs(20),
        "the frozen session held the row for {waited:?}"
    );
    stuck.abort();
    drop(proxy);
    mysql_drop(&pool, &table).await;
}

/// The MySQL error number of a store error that came from the server.
fn mysql_error_number(error: &StoreError) -> Option<u16> {
    let StoreError::Unavailable(source) = error else {
        return None;
    };
    let db = source.downcast_ref::<sqlx::Error>()?.as_database_error()?;
    Some(
        db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()?
            .number(),
    )
}

/// The store's own short transactions (a take-over, a heartbeat, a sweep) lower the
/// session's idle limit while they run, so a session frozen inside one is ended within
/// seconds and its row lock goes with it, and put it back when they end, committed or not:
/// a session left at 10 s would be ended by the server whenever the pool let it idle. One
/// pooled connection, so every statement here runs on the session the store used.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_short_transactions_put_the_idle_limit_back() {
    let table = unique_table("idle");
    let pool = mysql_pool(1).await;
    let store = mysql_store(pool.clone(), &table).await;
    let idle = async || -> u64 {
        sqlx::query_scalar("SELECT @@SESSION.wait_timeout")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = idle().await;
    assert_ne!(
        before, 10,
        "the session's idle limit is the server's, not the store's"
    );
    let key = unique_key("idle");
    let lease = Duration::from_millis(200);
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("rt"),
        lease,
        ttl: Duration::from_secs(3600),
        max_stored: 0,
    };
    let ClaimOutcome::Claimed(first) = store.claim(req).await.unwrap() else {
        panic!("not claimed")
    };
    // A heartbeat that commits, then one the fence refuses (rolled back).
    store.extend(&key, first.token, lease).await.unwrap();
    assert_eq!(idle().await, before, "after a heartbeat");
    assert!(matches!(
        store.extend(&key, LeaseToken::generate(), lease).await,
        Err(StoreError::StaleLease)
    ));
    assert_eq!(idle().await, before, "after a refused heartbeat");
    // A take-over once the lease ran out.
    tokio::time::sleep(lease * 2).await;
    assert!(matches!(
        store.claim(req).await.unwrap(),
        ClaimOutcome::Claimed(lease) if lease.took_over
    ));
    assert_eq!(idle().await, before, "after a take-over");
    store.purge_expired(100).await.unwrap();
    assert_eq!(idle().await, before, "after a sweep");
    mysql_drop(&pool, &table).await;
}

/// The sweeper never waits on a row another transaction holds (a single-commit take-over of
/// an expired record holds it until it commits): it deletes the other expired rows at once
/// and leaves that one to a later batch; meanwhile the rows it deleted are free at once.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_sweeper_skips_rows_a_transaction_holds() {
    let table = unique_table("sweep");
    let pool = mysql_pool(4).await;
    let store = mysql_store(pool.clone(), &table).await;
    let (k1, k2) = (unique_key("free"), unique_key("held"));
    for key in [&k1, &k2] {
        let req = ClaimRequest {
            key,
            fingerprint: &fp("s"),
            lease: Duration::from_millis(100),
            ttl: Duration::from_millis(100),
            max_stored: 0,
        };
        let ClaimOutcome::Claimed(lease) = store.claim(req).await.unwrap() else {
            panic!("not claimed")
        };
        store
            .complete(
                key,
                lease.token,
                &StoredResponse::new(201, "x").into(),
                req.ttl,
            )
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(400)).await; // both expired
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE"
    )))
    .bind(k2.scope.as_str())
    .bind(k2.key.as_str())
    .execute(&mut *holder)
    .await
    .unwrap();
    let purged = tokio::time::timeout(Duration::from_secs(5), store.purge_expired(100))
        .await
        .expect("the sweeper waited on a held row")
        .unwrap();
    assert_eq!(purged, 1, "the free expired row only");
    // A new request on the deleted key claims at once (the sweeper's locks are gone).
    let req = ClaimRequest {
        key: &k1,
        fingerprint: &fp("s"),
        lease: Duration::from_secs(10),
        ttl: Duration::from_secs(60),
        max_stored: 0,
    };
    let claimed = tokio::time::timeout(Duration::from_secs(5), store.claim(req))
        .await
        .expect("a claim waited on the sweeper")
        .unwrap();
    assert!(matches!(claimed, ClaimOutcome::Claimed(_)), "{claimed:?}");
    holder.rollback().await.unwrap();
    assert_eq!(
        store.purge_expired(100).await.unwrap(),
        1,
        "the other, once free"
    );
    mysql_drop(&pool, &table).await;
}

/// A pool whose sessions do not autocommit would leave plain mode's claims and completes
/// uncommitted (unseen by other instances, lost with the connection): `migrate` refuses it,
/// and so does every claim (503), rather than run handlers unprotected.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_refuses_sessions_without_autocommit() {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .test_before_acquire(false)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::raw_sql("SET SESSION autocommit = 0")
                    .execute(conn)
                    .await
                    .map(|_| ())
            })
        })
        .connect(&mysql_url())
        .await
        .unwrap();
    let table = unique_table("noauto");
    let store = idempotent_core::MySqlStore::builder(pool)
        .table(&table)
        .build()
        .unwrap();
    let refused = store.migrate().await.unwrap_err();
    assert!(refused.to_string().contains("autocommit"), "{refused}");
    // On a table made by a store whose sessions autocommit.
    let good = mysql_store(mysql_pool(2).await, &table).await;
    let key = unique_key("noauto");
    let req = ClaimRequest {
        key: &key,
        fingerprint: &fp("a"),
        lease: Duration::from_secs(10),
        ttl: Duration::from_secs(60),
        max_stored: 0,
    };
    assert!(matches!(
        store.claim(req).await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(good.get(&key).await.unwrap().is_none(), "nothing claimed");
    mysql_drop(good.pool(), &table).await;
}

/// A table name both MySQL and MariaDB reserve (`order`; MySQL 8 reserves more, such as
/// `rank`, that MariaDB does not): quoted everywhere, it works.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_reserved_table_names_are_quoted() {
    let pool = mysql_pool(2).await;
    let store = mysql_store(pool.clone(), "order").await;
    let engine = Engine::new(store.clone());
    warm_up(&engine).await;
    round_trips(&engine, || store.statements_sent(), 3).await;
    assert_eq!(store.purge_expired(10).await.unwrap(), 0);
    mysql_drop(&pool, "order").await;
}

/// A large sweeper batch of long keys (7,000 records whose scopes and keys take the most
/// bytes allowed, 1,024 and 255: about 18.8 MB of delete statements, more than the server's
/// `max_allowed_packet`) is sent as several queries, each under 1 MiB, and deletes them all.
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_sweeper_batches_fit_the_servers_packet() {
    let table = unique_table("bigsweep");
    let pool = mysql_pool(2).await;
    let store = mysql_store(pool.clone(), &table).await;
    let scope = "s".repeat(1024);
    for chunk in 0..14 {
        let mut sql = format!(
            "INSERT INTO {table} (scope, `key`, fingerprint, done, token, status, created_at, expires_at) VALUES "
        );
        for i in 0..500 {
            let n = chunk * 500 + i;
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push_str(&format!(
                "('{scope}', '{n:0>255}', X'00', TRUE, UNHEX(REPLACE(UUID(), '-', '')), 201, 1, 1)"
            ));
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    }
    let packet: u64 = sqlx::query_scalar("SELECT @@max_allowed_packet")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        packet < 18_000_000,
        "the batch must outgrow one packet: {packet}"
    );
    assert_eq!(store.purge_expired(7_000).await.unwrap(), 7_000);
    let left: i64 =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(left, 0);
    mysql_drop(&pool, &table).await;
}

/// Issue 49 (1): one instance's pool goes silent after its claims (a proxy freezes every
/// connection open then, its twelve warm connections; new ones pass), while three handlers run
/// three leases each. Their heartbeats must keep every lease (each renewal bounded, the
/// silent connection closed, the second attempt on a connection opened for it), so the other
/// instance, retrying every quarter lease, gets 409 for the whole run and then the stored
/// responses: never a take-over, never a second run. Three at once, with idle frozen
/// connections left in the pool, because a fresh connection must go to each renewal that
/// asks, not to one of them (review: a flag the store kept let only the first have it).
/// Before the fix the renewal waited on the frozen connection and the retry took the record
/// over one lease after the claim.
async fn frozen_pool_keeps_its_lease(
    frozen: Arc<dyn Store>,
    direct: Arc<dyn Store>,
    proxy: &idempotent_tests::stall::StallingProxy,
) {
    let lease = Duration::from_secs(2);
    let policy = Policy {
        lease,
        ..Policy::default()
    };
    let a = Engine::builder_from_arc(frozen)
        .lease(lease)
        .build()
        .unwrap();
    let b = Engine::builder_from_arc(direct)
        .lease(lease)
        .build()
        .unwrap();
    let keys: Vec<RecordKey> = (0..3)
        .map(|i| unique_key(&format!("frozen-pool-{i}")))
        .collect();
    let mut executions = Vec::new();
    for key in &keys {
        let Begin::Claimed(execution) = a.begin(request(key), &policy).await else {
            panic!("the first request claims")
        };
        executions.push(execution);
    }
    proxy.freeze_open();
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(keys.len() as u32));
    let first: Vec<_> = executions
        .into_iter()
        .enumerate()
        .map(|(i, mut execution)| {
            tokio::spawn(async move {
                let response = execution
                    .run(async {
                        tokio::time::sleep(lease * 3).await;
                        StoredResponse::new(201, format!("first {i}"))
                    })
                    .await
                    .unwrap();
                execution.finish(response.into()).await
            })
        })
        .collect();
    let started = std::time::Instant::now();
    let mut replayed = vec![false; keys.len()];
    while replayed.iter().any(|r| !r) {
        tokio::time::sleep(lease / 4).await;
        let at = started.elapsed();
        for (i, key) in keys.iter().enumerate() {
            if replayed[i] {
                continue;
            }
            match b.begin(request(key), &policy).await {
                Begin::InProgress { .. } => {
                    assert!(
                        at < Duration::from_secs(60),
                        "still in progress after {at:?}"
                    );
                }
                Begin::Replay(StoredOutcome::Response(r)) => {
                    assert_eq!(r.body, format!("first {i}").into_bytes());
                    assert!(at >= lease * 3, "replayed before the handler ended: {at:?}");
                    replayed[i] = true;
                }
                Begin::Claimed(execution) => {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    execution.release().await;
                    panic!(
                        "the retry took record {i} over at {at:?}: the lease lapsed under a live handler"
                    );
                }
                other => panic!("at {at:?}: {other:?}"),
            }
        }
    }
    for first in first {
        assert!(matches!(first.await.unwrap(), Recorded::Stored));
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert!(
        proxy.stalled() >= 3,
        "fewer connections were frozen than renewals ran: the test proves little"
    );
}

/// `pool` with all its connections open and idle (twelve at once, each held a moment): more
/// than three executions' renewals can use up in two rounds, so a second attempt that goes
/// back to the pool finds a frozen one.
async fn warm<DB: sqlx::Database>(pool: sqlx::Pool<DB>) -> sqlx::Pool<DB> {
    let held: Vec<_> = futures_util::future::join_all((0..12).map(|_| pool.acquire()))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    drop(held);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool.num_idle(), 12, "the pool is warm");
    pool
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_a_pool_gone_silent_keeps_its_lease() {
    use idempotent_tests::stall::StallingProxy;
    let table = unique_table("silent");
    let pool = pg_pool(4).await;
    let direct = pg_store(pool.clone(), &table).await;
    let proxy = StallingProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let url = database_url().replace("127.0.0.1:5432", &proxy.addr().to_string());
    assert_ne!(url, database_url(), "DATABASE_URL must name 127.0.0.1:5432");
    let frozen = PostgresStore::builder(
        warm(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(12)
                .test_before_acquire(false)
                .connect(&url)
                .await
                .unwrap(),
        )
        .await,
    )
    .schema("idempotent_test")
    .table(&table)
    .build()
    .unwrap();
    frozen_pool_keeps_its_lease(Arc::new(frozen), Arc::new(direct), &proxy).await;
    pg_drop(&pool, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_a_pool_gone_silent_keeps_its_lease() {
    use idempotent_tests::stall::StallingProxy;
    let table = unique_table("silent");
    let pool = mysql_pool(4).await;
    let direct = mysql_store(pool.clone(), &table).await;
    let proxy = StallingProxy::start("127.0.0.1:3306".parse().unwrap()).await;
    let url = mysql_url().replace("127.0.0.1:3306", &proxy.addr().to_string());
    assert_ne!(url, mysql_url(), "MYSQL_URL must name 127.0.0.1:3306");
    let frozen = MySqlStore::builder(
        warm(
            sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(12)
                .test_before_acquire(false)
                .connect(&url)
                .await
                .unwrap(),
        )
        .await,
    )
    .table(&table)
    .build()
    .unwrap();
    frozen_pool_keeps_its_lease(Arc::new(frozen), Arc::new(direct), &proxy).await;
    mysql_drop(&pool, &table).await;
}
