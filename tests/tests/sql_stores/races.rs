//! Races for one key: claims across two pools (two instances) and two processes each get
//! exactly one winner per key, on SQLite, PostgreSQL (also at a stricter default isolation)
//! and MySQL; instances migrating a new SQLite file at once all succeed; a serialization
//! failure inside a caller's own transaction (`claim_on`) is the caller's to see.

use super::*;

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

/// Instances starting at once on a new table: every migration succeeds (sqlx's own lock is no
/// lock on MariaDB, whose `GET_LOCK(name, -1)` answers at once: before the store's lock, two
/// runs inserted version 1 into the migrations table and one failed with a duplicate key).
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_instances_migrate_a_new_table_at_once() {
    let pools = [
        mysql_pool(2).await,
        mysql_pool(2).await,
        mysql_pool(2).await,
    ];
    for round in 0..10 {
        let table = unique_table("mig");
        let stores: Vec<_> = pools
            .iter()
            .map(|pool| {
                idempotent_core::MySqlStore::builder(pool.clone())
                    .table(&table)
                    .build()
                    .unwrap()
            })
            .collect();
        let migrated =
            futures_util::future::join_all(stores.iter().map(|store| store.migrate())).await;
        for (i, migrated) in migrated.into_iter().enumerate() {
            if let Err(e) = migrated {
                panic!("round {round}, instance {i}: {e}");
            }
        }
        let key = RecordKey::new(
            Scope::new("s").unwrap(),
            IdempotencyKey::parse(b"k").unwrap(),
        );
        let claimed = stores[2]
            .claim(ClaimRequest {
                key: &key,
                fingerprint: &fp("migrated"),
                lease: Duration::from_secs(60),
                ttl: Duration::from_secs(3600),
                max_stored: 0,
            })
            .await
            .unwrap();
        assert!(matches!(claimed, ClaimOutcome::Claimed(_)), "{claimed:?}");
        mysql_drop(&pools[0], &table).await;
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
