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
