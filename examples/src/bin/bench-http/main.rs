//! The HTTP benchmark: the same handler **bare** and **annotated** (`#[idempotent]`), on Axum
//! and Actix-web, on the memory store, SQLite, PostgreSQL, MySQL and Redis, driven by 64 keep-alive
//! connections for a fixed time, arms alternating round by round, medians reported with the
//! ratio annotated ÷ bare from the same run.
//!
//! ```text
//! cargo run --release -p idempotent-examples --bin bench-http -- --out bench-http.md
//! ```
//!
//! Each arm is its own server process (this binary's hidden `serve` command). On a machine
//! with two or more CPUs the load generator runs on CPU 0 and every server on CPU 1
//! (`taskset`), so they do not take each other's time; PostgreSQL and MySQL run where the
//! kernel puts them. The handler parses a JSON order and answers a JSON object; on SQL stores the bare arm
//! writes one row in its own transaction, the `tx` arm writes it in transactional mode (single
//! commit, the default path on both databases) and the `plain` arm in its own transaction
//! under the attribute's plain mode. Every run checks the server's execution count against
//! what the scenario allows (a new key runs the handler exactly once, a replay never), so a
//! benchmark that replays instead of executing fails. Each table also gives the server
//! process's CPU time (user and system, from `/proc`, in 10 ms ticks) per answered request:
//! it moves less than req/s with the load generator's share of the machine (though it
//! includes the kernel's work of waking the load generator for each response). On PostgreSQL a second pass through a
//! counting proxy reports statements, round trips and write transactions per request.
//! `--json FILE` writes the tables' medians as JSON rows; `docs/benchmarks/run.sh` runs the
//! documented settings and draws `docs/benchmarks/ratios.svg` from them. See BENCHMARKS.md for
//! the figures.

mod actix_arm;
mod axum_arm;
mod load;
mod server;
mod wire;

use clap::{Parser, Subcommand, ValueEnum};
use load::Scenario;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::process::{ExitCode, Stdio};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Debug, Parser)]
#[command(about = "HTTP benchmark: the same handler bare and annotated, side by side")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serves one arm (started by the benchmark itself).
    #[command(hide = true)]
    Serve(ServeArgs),
}

/// Whether the servers observe (`--observe`), set once in `main`.
static OBSERVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// The servers' pool size on PostgreSQL and MySQL (`--pool`), set once in `main`.
static POOL: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// Whether the annotated servers keep a replay cache (`--replay-cache`), set once in `main`.
static REPLAY_CACHE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Every server, bare and annotated alike, installs a `tracing-subscriber` fmt subscriber
    /// at the default level (`info`: the idempotency spans, at `debug`, are filtered) and the
    /// Prometheus metrics recorder, so the difference is the cost of observing.
    #[arg(long)]
    observe: bool,
    /// Stores to measure.
    #[arg(long, value_delimiter = ',', default_values = ["memory", "sqlite", "postgres", "mysql", "redis"])]
    stores: Vec<StoreKind>,
    /// Frameworks to measure.
    #[arg(long, value_delimiter = ',', default_values = ["axum", "actix"])]
    frameworks: Vec<Framework>,
    /// Scenarios to run.
    #[arg(long, value_delimiter = ',', default_values = ["first", "replay", "mix", "dup8"])]
    scenarios: Vec<ScenarioArg>,
    /// Measured rounds per scenario (every arm once per round, in rotating order).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Length of one measured run.
    #[arg(long, default_value = "5s", value_parser = parse_secs)]
    duration: Duration,
    /// Length of the warm-up run of each arm before a scenario's rounds.
    #[arg(long, default_value = "1s", value_parser = parse_secs)]
    warmup: Duration,
    /// Concurrent keep-alive connections.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// PostgreSQL URL (default `$DATABASE_URL`); the benchmark's tables live in the schema
    /// `bench_http`, dropped at the start of a run.
    #[arg(long)]
    database: Option<String>,
    /// MySQL or MariaDB URL (default `$MYSQL_URL`, else `mysql://root@127.0.0.1:3306/test`); the
    /// benchmark's tables in the database it names are `bench_http_*`, dropped when a run
    /// starts and when it ends.
    #[arg(long)]
    mysql: Option<String>,
    /// Redis URL for the Redis store (default `$REDIS_URL`, else `redis://127.0.0.1:6379`;
    /// `redis+cluster://…` for a cluster). The records go under the prefix `bench-http:`,
    /// deleted at the end of the run.
    #[arg(long)]
    redis: Option<String>,
    /// Connections in each server's pool on PostgreSQL and MySQL (bare and annotated alike).
    /// A framework's three servers run at once, and on PostgreSQL the counting pass starts a
    /// fourth beside them (its load uses up to 8 connections) while the run holds one more:
    /// 3 × N + 9 must fit in the database's `max_connections` (PostgreSQL's default of 100
    /// allows N ≤ 30). Past it, sqlx retries the refused connections and the run stalls.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pool: u32,
    /// The annotated servers' engines keep a replay cache (`ReplayCache::new()`, its
    /// defaults), so replays of the keys they finished are answered from memory.
    #[arg(long)]
    replay_cache: bool,
    /// Do not pin the load generator and the servers to separate CPUs.
    #[arg(long)]
    no_pin: bool,
    /// Length of each scenario's run through the counting proxy (PostgreSQL).
    #[arg(long, default_value = "2s", value_parser = parse_secs)]
    wire_duration: Duration,
    /// Also write the report (Markdown) to this file.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Also write the summary (JSON) to this file: the run's settings, date and machine, and a
    /// row per framework, store, scenario and arm (`framework`, `store`, `scenario`, `arm`,
    /// `rps`, `p50_ms`, `p99_ms`, `cpu_us`, `ratio` to bare's req/s), the medians of the
    /// Markdown tables. The store is `redis-cluster` for a `redis+cluster://` URL.
    /// `docs/benchmarks/chart.py` draws it.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    Memory,
    Sqlite,
    Postgres,
    #[value(name = "mysql")]
    MySql,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
enum Framework {
    Axum,
    Actix,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ScenarioArg {
    First,
    Replay,
    Mix,
    Dup8,
}

impl From<ScenarioArg> for Scenario {
    fn from(s: ScenarioArg) -> Self {
        match s {
            ScenarioArg::First => Scenario::First,
            ScenarioArg::Replay => Scenario::Replay,
            ScenarioArg::Mix => Scenario::Mix,
            ScenarioArg::Dup8 => Scenario::Dup8,
        }
    }
}

/// Which handler a server runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
enum Arm {
    /// No attribute.
    Bare,
    /// `#[idempotent]`, plain mode: the handler's write and the record commit apart.
    Plain,
    /// `#[idempotent]` with a `Transaction<DB>`: single commit.
    Tx,
}

impl Arm {
    fn label(self) -> &'static str {
        match self {
            Arm::Bare => "bare",
            Arm::Plain => "annotated, plain mode",
            Arm::Tx => "annotated, transactional (single commit)",
        }
    }
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    #[arg(long)]
    framework: Framework,
    #[arg(long)]
    arm: Arm,
    /// `memory`, `sqlite://FILE`, `postgres://…`, `mysql://…` or `redis://…`.
    #[arg(long)]
    database: String,
    /// Makes the server's order ids unique.
    #[arg(long)]
    tag: String,
    /// Install the subscriber and the recorder (see the run's `--observe`).
    #[arg(long)]
    observe: bool,
    /// The pool's size on PostgreSQL and MySQL (see the run's `--pool`).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pool: u32,
    /// A replay cache in the engine (see the run's `--replay-cache`).
    #[arg(long)]
    replay_cache: bool,
}

/// The annotated arms' engine over `store`, with the replay cache `args` asks for.
fn engine(
    args: &ServeArgs,
    store: std::sync::Arc<dyn idempotent_core::Store>,
) -> Result<idempotent_core::Engine, String> {
    let mut engine = idempotent_core::Engine::builder_from_arc(store);
    if args.replay_cache {
        engine = engine.replay_cache(idempotent_core::engine::ReplayCache::new());
    }
    engine.build().map_err(|e| e.to_string())
}

/// What `--observe` installs in a server: the examples' subscriber (stderr, `RUST_LOG` or
/// `info`) and the Prometheus recorder (its handle unused: nothing scrapes during the run).
fn observe_setup(args: &ServeArgs) -> Result<(), String> {
    if args.observe {
        idempotent_examples::api::init_logging();
        idempotent_examples::api::install_metrics()?;
    }
    Ok(())
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    idempotent_core::parse_duration(s).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _ = OBSERVE.set(cli.run.observe);
    let _ = POOL.set(cli.run.pool);
    let _ = REPLAY_CACHE.set(cli.run.replay_cache);
    if let Some(Command::Serve(args)) = cli.command {
        if let Err(e) = observe_setup(&args) {
            eprintln!("bench-http serve: {e}");
            return ExitCode::FAILURE;
        }
        let served = match args.framework {
            Framework::Axum => axum_arm::serve(&args),
            Framework::Actix => actix_arm::serve(&args),
        };
        return match served {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench-http serve: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let pinned = !cli.run.no_pin && pin_self();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench-http: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli.run, pinned)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench-http: some runs failed their checks (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("bench-http: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Pins this process (before any thread starts) to CPU 0 when there are at least two and
/// `taskset` exists; servers then go to CPU 1.
fn pin_self() -> bool {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    cpus >= 2
        && std::process::Command::new("taskset")
            .args(["-pc", "0", &std::process::id().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// A running server process.
struct Server {
    /// Killed when dropped.
    _child: tokio::process::Child,
    /// The server's process (`taskset` execs it, so the same one when pinned).
    pid: Option<u32>,
    /// Kept open, so the server never writes into a closed pipe.
    _stdout: BufReader<tokio::process::ChildStdout>,
    addr: SocketAddr,
}

impl Server {
    async fn start(
        framework: Framework,
        arm: Arm,
        database: &str,
        tag: &str,
        pinned: bool,
    ) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut cmd = if pinned {
            let mut c = tokio::process::Command::new("taskset");
            c.args(["-c", "1"]).arg(exe);
            c
        } else {
            tokio::process::Command::new(exe)
        };
        let framework_name = format!("{framework:?}").to_lowercase();
        let arm_name = format!("{arm:?}").to_lowercase();
        cmd.args(["serve", "--framework", &framework_name, "--arm", &arm_name])
            .args(["--database", database, "--tag", tag]);
        if OBSERVE.get().copied().unwrap_or(false) {
            cmd.arg("--observe");
        }
        if let Some(pool) = POOL.get() {
            cmd.args(["--pool", &pool.to_string()]);
        }
        if REPLAY_CACHE.get().copied().unwrap_or(false) {
            cmd.arg("--replay-cache");
        }
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| format!("starting a server: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut line = String::new();
        let mut stdout = BufReader::new(stdout);
        let read = stdout.read_line(&mut line);
        tokio::time::timeout(Duration::from_secs(60), read)
            .await
            .map_err(|_| format!("{framework_name} {arm_name}: no address within 60 s"))?
            .map_err(|e| e.to_string())?;
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| {
                format!("{framework_name} {arm_name} on {database}: exited ({line:?})")
            })?;
        Ok(Server {
            pid: child.id(),
            _child: child,
            _stdout: stdout,
            addr,
        })
    }

    /// The CPU time the server's process has used so far (user and system, all its threads),
    /// in clock ticks, from `/proc/<pid>/stat`; `None` where that cannot be read.
    fn cpu_ticks(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid?)).ok()?;
        // The fields after the command name (which may hold spaces) start at the state, the
        // third field; utime and stime are the 14th and 15th.
        let mut fields = stat.get(stat.rfind(')')? + 2..)?.split(' ').skip(11);
        let user: u64 = fields.next()?.parse().ok()?;
        let system: u64 = fields.next()?.parse().ok()?;
        Some(user + system)
    }
}

/// Clock ticks per second in `/proc/<pid>/stat` (`USER_HZ`, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// One measured run of one arm.
struct Measured {
    per_second: f64,
    p50_us: u32,
    p99_us: u32,
    conflicts: f64,
    executions_per_request: f64,
    /// The server's CPU time per answered request, in µs (`None` where it cannot be read).
    cpu_us: Option<f64>,
}

/// Runs `scenario` against `server` and checks the handler's executions against what the
/// scenario allows; a failed check is printed and makes the whole benchmark fail.
async fn measure(
    server: &Server,
    arm: Arm,
    scenario: Scenario,
    (ns, replay_ns): (&str, &str),
    (connections, duration): (usize, Duration),
    ok: &mut bool,
) -> Result<Measured, String> {
    let before = load::executions(server.addr).await?;
    let cpu_before = server.cpu_ticks();
    let mut sample = load::run(server.addr, scenario, ns, replay_ns, connections, duration).await;
    let cpu_after = server.cpu_ticks();
    let executions = load::executions(server.addr).await? - before;
    let mut problems = Vec::new();
    if sample.errors > 0 {
        problems.push(format!(
            "{} errors, the first: {}",
            sample.errors,
            sample.first_error.as_deref().unwrap_or("?")
        ));
    }
    if sample.ok == 0 {
        problems.push("no request answered".to_owned());
    }
    // Every answered new key ran the handler exactly once; a replay never did. Of 8
    // duplicates, the one that claimed the key answers after its execution, so (without
    // errors) each key sent ran exactly once.
    let want = match (arm, scenario) {
        (Arm::Bare, _) => sample.ok,
        (_, Scenario::First) => sample.ok,
        (_, Scenario::Replay) => 0,
        (_, Scenario::Mix) => sample.fresh_ok,
        (_, Scenario::Dup8) => sample.distinct_keys,
    };
    if executions != want {
        problems.push(format!(
            "the handler ran {executions} times where the answers allow exactly {want}"
        ));
    }
    if arm == Arm::Bare && sample.conflicts > 0 {
        problems.push("the bare handler answered 409".to_owned());
    }
    if !problems.is_empty() {
        *ok = false;
        eprintln!(
            "CHECK FAILED ({}, {}): {}",
            arm.label(),
            scenario.name(),
            problems.join("; ")
        );
    }
    let answered = sample.answered().max(1) as f64;
    Ok(Measured {
        per_second: sample.per_second(),
        p50_us: sample.quantile_us(0.50),
        p99_us: sample.quantile_us(0.99),
        conflicts: sample.conflicts as f64 / answered,
        executions_per_request: executions as f64 / answered,
        cpu_us: cpu_before
            .zip(cpu_after)
            .map(|(b, a)| a.saturating_sub(b) as f64 / TICKS_PER_SECOND * 1e6 / answered),
    })
}

/// What `--json` writes.
#[derive(serde::Serialize)]
struct Summary {
    format: &'static str,
    date: String,
    machine: String,
    settings: Settings,
    rows: Vec<Row>,
}

/// The run's settings, in `--json`.
#[derive(serde::Serialize)]
struct Settings {
    connections: usize,
    rounds: usize,
    duration_s: f64,
    warmup_s: f64,
    pool: u32,
    pinned: bool,
    observe: bool,
}

/// One row of `--json`: the medians of an arm's rounds, as its Markdown table gives them.
#[derive(serde::Serialize)]
struct Row {
    framework: Framework,
    /// `memory`, `sqlite`, `postgres`, `mysql`, `redis` or `redis-cluster`.
    store: &'static str,
    /// `first`, `replay`, `mix` or `dup8`.
    scenario: &'static str,
    arm: Arm,
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// The server's CPU time a request, µs (`null` where `/proc` could not be read).
    cpu_us: Option<f64>,
    /// `rps` ÷ the bare arm's `rps` in the same table (1 for bare).
    ratio: f64,
}

/// The store's name in `--json`: a Redis Cluster is told apart by its URL.
fn store_name(store: StoreKind, redis_url: &str) -> &'static str {
    match store {
        StoreKind::Memory => "memory",
        StoreKind::Sqlite => "sqlite",
        StoreKind::Postgres => "postgres",
        StoreKind::MySql => "mysql",
        StoreKind::Redis if redis_url.starts_with("redis+cluster") => "redis-cluster",
        StoreKind::Redis => "redis",
    }
}

/// `x` to `digits` decimals, so the JSON reads as the tables do.
fn round(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (x * scale).round() / scale
}

fn scenario_name(scenario: Scenario) -> &'static str {
    match scenario {
        Scenario::First => "first",
        Scenario::Replay => "replay",
        Scenario::Mix => "mix",
        Scenario::Dup8 => "dup8",
    }
}

/// The machine, for `--json`: CPUs, the CPU's model name and the memory, from `/proc` (this
/// process is pinned to one CPU by then, so not from its affinity).
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpus = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map_or("unknown CPU", |(_, m)| m.trim());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            let kib: f64 = t
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(format!(", {:.1} GiB", kib / 1024.0 / 1024.0))
        })
        .unwrap_or_default();
    format!("{cpus} CPUs, {model}{memory}")
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn arms(store: StoreKind) -> &'static [Arm] {
    match store {
        StoreKind::Memory | StoreKind::Redis => &[Arm::Bare, Arm::Plain],
        StoreKind::Sqlite | StoreKind::Postgres | StoreKind::MySql => {
            &[Arm::Bare, Arm::Tx, Arm::Plain]
        }
    }
}

async fn run(args: RunArgs, pinned: bool) -> Result<bool, String> {
    let pg_url = args
        .database
        .clone()
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .filter(|u| u.starts_with("postgres"));
    let mut stores = args.stores.clone();
    if stores.contains(&StoreKind::Postgres) && pg_url.is_none() {
        eprintln!("bench-http: PostgreSQL skipped: no --database and no DATABASE_URL");
        stores.retain(|s| *s != StoreKind::Postgres);
    }
    let pg = match &pg_url {
        Some(url) if stores.contains(&StoreKind::Postgres) => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(url)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            sqlx::raw_sql("DROP SCHEMA IF EXISTS bench_http CASCADE")
                .execute(&pool)
                .await
                .map_err(|e| e.to_string())?;
            Some(pool)
        }
        _ => None,
    };
    let mysql_url = args
        .mysql
        .clone()
        .or_else(|| std::env::var("MYSQL_URL").ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".to_owned());
    if stores.contains(&StoreKind::MySql) {
        drop_mysql_tables(&mysql_url).await?;
    }
    let redis_url = args
        .redis
        .clone()
        .or_else(|| std::env::var("REDIS_URL").ok())
        .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
    let dir = std::env::temp_dir().join(format!("bench-http-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut report = String::new();
    let mut rows = Vec::new();
    let date = chrono_free_date();
    let _ = writeln!(
        report,
        "bench-http: {} connections, {} rounds of {:?} after a {:?} warm-up per arm{}; load generator {}; {}",
        args.connections,
        args.rounds,
        args.duration,
        args.warmup,
        if stores
            .iter()
            .any(|s| matches!(s, StoreKind::Postgres | StoreKind::MySql))
        {
            format!("; pools of {} on PostgreSQL and MySQL", args.pool)
        } else {
            String::new()
        },
        if pinned {
            "on CPU 0, servers on CPU 1 (taskset)"
        } else {
            "not pinned"
        },
        date,
    );
    println!("{report}");
    let mut all_ok = true;
    for store in stores {
        for &framework in &args.frameworks {
            let mut servers = Vec::new();
            for &arm in arms(store) {
                let tag = format!("{framework:?}-{arm:?}").to_lowercase();
                let database = match store {
                    StoreKind::Memory => "memory".to_owned(),
                    StoreKind::Sqlite => {
                        format!("sqlite://{}", dir.join(format!("{tag}.db")).display())
                    }
                    StoreKind::Postgres => pg_url.clone().unwrap_or_default(),
                    StoreKind::MySql => mysql_url.clone(),
                    StoreKind::Redis => redis_url.clone(),
                };
                let server = Server::start(framework, arm, &database, &tag, pinned).await?;
                load::seed_replays(server.addr, &format!("seed-{tag}")).await?;
                servers.push((arm, tag, server));
            }
            for &scenario in &args.scenarios {
                let scenario = Scenario::from(scenario);
                let mut results: Vec<Vec<Measured>> = servers.iter().map(|_| Vec::new()).collect();
                for (arm, tag, server) in &servers {
                    let ns = format!("warm-{tag}-{scenario:?}");
                    measure(
                        server,
                        *arm,
                        scenario,
                        (&ns, &format!("seed-{tag}")),
                        (args.connections, args.warmup),
                        &mut all_ok,
                    )
                    .await?;
                }
                for round in 0..args.rounds {
                    for i in 0..servers.len() {
                        let at = (i + round) % servers.len();
                        let (arm, tag, server) = &servers[at];
                        let ns = format!("{tag}-{scenario:?}-{round}");
                        let m = measure(
                            server,
                            *arm,
                            scenario,
                            (&ns, &format!("seed-{tag}")),
                            (args.connections, args.duration),
                            &mut all_ok,
                        )
                        .await?;
                        results[at].push(m);
                    }
                }
                let table = table(
                    (store, store_name(store, &redis_url)),
                    framework,
                    scenario,
                    &servers,
                    results,
                    &mut rows,
                );
                println!("{table}");
                report.push_str(&table);
            }
            if let (StoreKind::Postgres, Some(pool)) = (store, &pg) {
                let url = pg_url.clone().unwrap_or_default();
                let table = count_wire(framework, &args, &url, pool, pinned).await?;
                println!("{table}");
                report.push_str(&table);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if args.stores.contains(&StoreKind::MySql) {
        drop_mysql_tables(&mysql_url).await?;
    }
    if args.stores.contains(&StoreKind::Redis) {
        server::redis_cleanup(&redis_url).await;
    }
    if let Some(out) = &args.out {
        std::fs::write(out, &report).map_err(|e| format!("{}: {e}", out.display()))?;
    }
    if let Some(path) = &args.json {
        let summary = Summary {
            format: "bench-http 1",
            date,
            machine: machine(),
            settings: Settings {
                connections: args.connections,
                rounds: args.rounds,
                duration_s: args.duration.as_secs_f64(),
                warmup_s: args.warmup.as_secs_f64(),
                pool: args.pool,
                pinned,
                observe: args.observe,
            },
            rows,
        };
        let text = serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())? + "\n";
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(all_ok)
}

/// Drops the benchmark's MySQL tables ([`server::MYSQL_TABLES`]) from the database `url` names.
async fn drop_mysql_tables(url: &str) -> Result<(), String> {
    use sqlx::Connection;
    let mut conn = sqlx::MySqlConnection::connect(url)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let sql = format!("DROP TABLE IF EXISTS {}", server::MYSQL_TABLES.join(", "));
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let _ = conn.close().await;
    Ok(())
}

fn chrono_free_date() -> String {
    std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The Markdown table of one framework, store and scenario; its rows also go to `rows`.
fn table(
    (store, store_name): (StoreKind, &'static str),
    framework: Framework,
    scenario: Scenario,
    servers: &[(Arm, String, Server)],
    results: Vec<Vec<Measured>>,
    rows: &mut Vec<Row>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{framework:?}, {store:?}, {}\n\n| arm | req/s (median) | p50 ms | p99 ms | ÷ bare | server CPU µs per request | 409s | executions per request | rounds (req/s) |\n|---|---|---|---|---|---|---|---|---|",
        scenario.name()
    );
    let medians: Vec<f64> = results
        .iter()
        .map(|r| median(r.iter().map(|m| m.per_second).collect()))
        .collect();
    let bare = servers
        .iter()
        .position(|(arm, ..)| *arm == Arm::Bare)
        .map_or(0.0, |i| medians[i]);
    for ((arm, ..), (runs, rps)) in servers.iter().zip(results.iter().zip(&medians)) {
        let p50 = median(runs.iter().map(|m| f64::from(m.p50_us)).collect()) / 1000.0;
        let p99 = median(runs.iter().map(|m| f64::from(m.p99_us)).collect()) / 1000.0;
        let conflicts = median(runs.iter().map(|m| m.conflicts).collect());
        let execs = median(runs.iter().map(|m| m.executions_per_request).collect());
        let rounds: Vec<String> = runs
            .iter()
            .map(|m| format!("{:.0}", m.per_second))
            .collect();
        let ratio = if bare > 0.0 { rps / bare } else { 0.0 };
        let cpu: Option<Vec<f64>> = runs.iter().map(|m| m.cpu_us).collect();
        let cpu_us = cpu.map(median);
        rows.push(Row {
            framework,
            store: store_name,
            scenario: scenario_name(scenario),
            arm: *arm,
            rps: round(*rps, 1),
            p50_ms: round(p50, 3),
            p99_ms: round(p99, 3),
            cpu_us: cpu_us.map(|c| round(c, 1)),
            ratio: if *arm == Arm::Bare {
                1.0
            } else {
                round(ratio, 4)
            },
        });
        let cpu = cpu_us.map_or_else(|| "–".to_owned(), |c| format!("{c:.1}"));
        let _ = writeln!(
            out,
            "| {} | {rps:.0} | {p50:.2} | {p99:.2} | {} | {cpu} | {:.1} % | {execs:.2} | {} |",
            arm.label(),
            if *arm == Arm::Bare {
                "1".to_owned()
            } else {
                format!("**{ratio:.2}**")
            },
            conflicts * 100.0,
            rounds.join(", ")
        );
    }
    out
}

/// Statements, round trips and write transactions per request on PostgreSQL, through the
/// counting proxy (8 connections, `--wire-duration` per scenario and arm).
async fn count_wire(
    framework: Framework,
    args: &RunArgs,
    url: &str,
    pool: &sqlx::PgPool,
    pinned: bool,
) -> Result<String, String> {
    // The servers connect through the proxy: the same options, another address, no TLS.
    let options: sqlx::postgres::PgConnectOptions =
        url.parse().map_err(|e| format!("{url}: {e}"))?;
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .map_err(|e| format!("{}: {e}", options.get_host()))?
        .collect();
    let upstream = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{}: no address", options.get_host()))?;
    let (proxy, counts) = wire::start(upstream).await.map_err(|e| e.to_string())?;
    let options = options
        .host(&proxy.ip().to_string())
        .port(proxy.port())
        .ssl_mode(sqlx::postgres::PgSslMode::Disable);
    let proxied = sqlx::ConnectOptions::to_url_lossy(&options).to_string();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{framework:?}, PostgreSQL, on the wire (8 connections through a counting proxy)\n\n| scenario | arm | statements per request | round trips per request | write transactions per request |\n|---|---|---|---|---|"
    );
    for &arm in arms(StoreKind::Postgres) {
        let tag = format!("wire-{framework:?}-{arm:?}").to_lowercase();
        let server = Server::start(framework, arm, &proxied, &tag, pinned).await?;
        load::seed_replays(server.addr, &format!("seed-{tag}")).await?;
        for &scenario in &args.scenarios {
            let scenario = Scenario::from(scenario);
            let xids = |pool: &sqlx::PgPool| {
                let pool = pool.clone();
                async move {
                    sqlx::query_scalar::<_, String>(
                        "SELECT pg_snapshot_xmax(pg_current_snapshot())::text",
                    )
                    .fetch_one(&pool)
                    .await
                    .map_err(|e| e.to_string())?
                    .parse::<u64>()
                    .map_err(|e| e.to_string())
                }
            };
            let x0 = xids(pool).await?;
            let (s0, r0) = counts.read();
            let mut sample = load::run(
                server.addr,
                scenario,
                &format!("{tag}-{scenario:?}"),
                &format!("seed-{tag}"),
                8,
                args.wire_duration,
            )
            .await;
            // Let the pool's release pings of the last requests arrive.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (s1, r1) = counts.read();
            let x1 = xids(pool).await?;
            let n = sample.answered().max(1) as f64;
            if sample.errors > 0 {
                eprintln!(
                    "wire count {tag} {scenario:?}: {} errors: {:?}",
                    sample.errors,
                    sample.first_error.take()
                );
            }
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} | {:.2} | {:.2} |",
                scenario.name(),
                arm.label(),
                (s1 - s0) as f64 / n,
                (r1 - r0) as f64 / n,
                x1.saturating_sub(x0) as f64 / n,
            );
        }
        drop(server);
    }
    Ok(out)
}
