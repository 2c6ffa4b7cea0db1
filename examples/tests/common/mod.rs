//! What the example tests share: the charges servers as real processes.
#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A running server; killed on drop.
pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Which binary serves the API.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Bin {
    Axum,
    Actix,
}

impl Bin {
    /// This build's binary, or `CHARGES_AXUM_BIN` / `CHARGES_ACTIX_BIN` (to run these tests
    /// against another build, such as a release before a fix, to see them fail there).
    pub(crate) fn path(self) -> String {
        let (var, built) = match self {
            Bin::Axum => ("CHARGES_AXUM_BIN", env!("CARGO_BIN_EXE_charges-axum")),
            Bin::Actix => ("CHARGES_ACTIX_BIN", env!("CARGO_BIN_EXE_charges-actix")),
        };
        std::env::var(var).unwrap_or_else(|_| built.to_owned())
    }
}

pub(crate) fn start(bin: Bin, database: &str, extra: &[&str]) -> Server {
    start_reading(bin, database, extra).0
}

/// [`start`], keeping the server's stdout for what it prints after its first line.
pub(crate) fn start_reading(
    bin: Bin,
    database: &str,
    extra: &[&str],
) -> (Server, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(bin.path())
        .args(["--listen", "127.0.0.1:0", "--database", database])
        // The database's own secret, whatever the environment holds.
        .env_remove("IDEMPOTENCY_SECRET")
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    out.read_line(&mut line).unwrap();
    let base = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("first line: {line:?}"))
        .to_owned();
    (Server { child, base }, out)
}

/// Waits, off the runtime's workers, until a server started with `--announce-work` prints
/// `working` (its handler has paid and written its charge, inside its transaction).
pub(crate) async fn until_working(mut out: BufReader<std::process::ChildStdout>) {
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    assert_eq!(line.trim(), "working");
}

/// A database of its own (`idem_<uuid>`) on the MySQL or MariaDB server of `MYSQL_URL`,
/// dropped with everything in it when this is dropped (after the servers using it: declare
/// it before them). `url` names it, with `MYSQL_URL`'s user, host and options.
pub(crate) struct MySqlDb {
    pub(crate) url: String,
    server: String,
    name: String,
}

impl MySqlDb {
    pub(crate) async fn create() -> Self {
        let server = std::env::var("MYSQL_URL").expect("MYSQL_URL");
        let name = format!("idem_{}", uuid::Uuid::new_v4().simple());
        mysql_admin(&server, &format!("CREATE DATABASE {name}")).await;
        // `mysql://user@host:port/db?options`: the path is the database.
        let (address, query) = server.split_once('?').unwrap_or((server.as_str(), ""));
        let authority = address.find("://").map_or(0, |at| at + 3);
        let host_end = address[authority..]
            .find('/')
            .map_or(address.len(), |at| authority + at);
        let mut url = format!("{}/{name}", &address[..host_end]);
        if !query.is_empty() {
            url = format!("{url}?{query}");
        }
        MySqlDb { url, server, name }
    }
}

impl Drop for MySqlDb {
    fn drop(&mut self) {
        let (server, sql) = (
            self.server.clone(),
            format!("DROP DATABASE IF EXISTS {}", self.name),
        );
        // Its own thread and runtime: this may run inside a test's runtime (or its panic).
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(mysql_admin(&server, &sql));
        })
        .join();
    }
}

/// Runs one statement on a connection of its own to `server`.
async fn mysql_admin(server: &str, sql: &str) {
    use sqlx::Connection;
    let mut conn = sqlx::MySqlConnection::connect(server).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let _ = conn.close().await;
}
