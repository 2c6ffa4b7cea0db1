//! MySQL (MariaDB) specifics: the store's short transactions put the session's idle limit back,
//! sessions without autocommit are refused, reserved table names are quoted, and sweeper
//! batches fit the server's packet.

use super::*;

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
    let engine = unswept(store.clone());
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
