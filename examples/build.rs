//! Switches the example's PostgreSQL tests on when `DATABASE_URL` is set at build time; without it they
//! are compiled as `#[ignore]`d, so every run reports them as ignored (skipped), never as passed.
/// Likewise `MYSQL_URL` (MySQL or MariaDB) for the MySQL tests, and `REDIS_CLUSTER_URL` (a
/// Redis Cluster) and `REDIS_URL` (a standalone server) for the Redis tests.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(pg)");
    println!("cargo::rustc-check-cfg=cfg(mysql_db)");
    println!("cargo::rustc-check-cfg=cfg(redis_standalone)");
    println!("cargo::rustc-check-cfg=cfg(redis_cluster)");
    println!("cargo::rerun-if-env-changed=DATABASE_URL");
    println!("cargo::rerun-if-env-changed=MYSQL_URL");
    println!("cargo::rerun-if-env-changed=REDIS_URL");
    println!("cargo::rerun-if-env-changed=REDIS_CLUSTER_URL");
    if std::env::var("DATABASE_URL").is_ok_and(|u| u.starts_with("postgres")) {
        println!("cargo::rustc-cfg=pg");
    }
    if std::env::var("MYSQL_URL").is_ok_and(|u| u.starts_with("mysql") || u.starts_with("mariadb"))
    {
        println!("cargo::rustc-cfg=mysql_db");
    }
    if std::env::var("REDIS_URL").is_ok_and(|u| u.starts_with("redis")) {
        println!("cargo::rustc-cfg=redis_standalone");
    }
    if std::env::var("REDIS_CLUSTER_URL").is_ok_and(|u| u.starts_with("redis")) {
        println!("cargo::rustc-cfg=redis_cluster");
    }
}
