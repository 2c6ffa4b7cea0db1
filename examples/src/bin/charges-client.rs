//! Sends N charges to a charges server through a proxy that loses a share of them (requests
//! before the server, responses after the server wrote them), retrying each with one
//! `Idempotency-Key` through `idempotent_client::IdempotentRetry`; then prints how many
//! charges the account holds, on the last line. With one key per operation it is N, however
//! many attempts were lost.
//!
//! `cargo run -p idempotent-examples --bin charges-client -- --url http://127.0.0.1:3000 --count 100 --fail-rate 0.3`

use clap::Parser;
use futures_util::StreamExt;
use idempotent_client::IdempotentRetry;
use idempotent_examples::proxy::{DroppingProxy, Drops};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Charges through a lossy proxy, retried with one idempotency key per charge.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The charges server (`charges-axum` or `charges-actix`), `http://HOST:PORT`; charges go
    /// to `/v1/charges` there.
    #[arg(long, default_value = "http://127.0.0.1:3000")]
    url: String,
    /// How many charges (logical operations) to make.
    #[arg(long, default_value_t = 100)]
    count: usize,
    /// Share of attempts the proxy loses, in [0, 1): half as requests dropped before the
    /// server, half as responses dropped after it answered.
    #[arg(long, default_value_t = 0.3, value_parser = parse_rate)]
    fail_rate: f64,
    /// Seed of the proxy's draws (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Charges in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// The account (bearer token) to charge; default: a new one, so the count is this run's.
    #[arg(long)]
    account: Option<String>,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..1.0).contains(&r) => Ok(r),
        _ => Err(format!("`{s}` is not a rate in [0, 1)")),
    }
}

/// Attempts per operation so that, at `rate` lost per attempt, the chance that any of
/// `count` operations loses all of them is under one in a million: rate^attempts · count <
/// 1e-6. At least 3.
fn attempts_for(rate: f64, count: usize) -> u32 {
    if rate <= 0.0 {
        return 3;
    }
    let count = count.max(1) as f64;
    let needed = ((1e-6 / count).ln() / rate.ln()).ceil();
    if needed.is_finite() && needed > 3.0 {
        needed.min(100.0) as u32
    } else {
        3
    }
}

/// Per-attempt timeout: a server that answers slower than this is retried (409 meanwhile).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the start-up probe of each of the server's addresses may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// What the deadline allows per attempt for a server's `Retry-After`.
const RETRY_AFTER_ALLOWANCE: Duration = Duration::from_secs(2);
/// The backoff's bounds.
const MIN_WAIT: Duration = Duration::from_millis(10);
const MAX_WAIT: Duration = Duration::from_millis(500);

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("charges-client: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The server's address: the first of the host's addresses that accepts a connection (so
/// `localhost` works whether the server listens on IPv4 or IPv6).
async fn upstream(url: &reqwest::Url) -> Result<SocketAddr, String> {
    if url.scheme() != "http" {
        return Err(format!(
            "--url must be http:// (the proxy speaks plain HTTP), not {}",
            url.scheme()
        ));
    }
    // IPv6 literals come bracketed (`[::1]`); the resolver takes them bare.
    let host = url
        .host_str()
        .ok_or("the URL has no host")?
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = url.port_or_known_default().unwrap_or(80);
    let addrs = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| format!("cannot resolve {host}: {e}"))?;
    let mut last = format!("{host} resolves to no address");
    for addr in addrs {
        match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => return Ok(addr),
            Ok(Err(e)) => last = format!("cannot connect to {addr}: {e}"),
            Err(_) => last = format!("cannot connect to {addr}: no answer in {CONNECT_TIMEOUT:?}"),
        }
    }
    Err(last)
}

async fn run(args: &Args) -> Result<bool, String> {
    let base = reqwest::Url::parse(&args.url).map_err(|e| format!("bad --url: {e}"))?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let proxy = DroppingProxy::start(
        upstream(&base).await?,
        Drops::Random {
            rate: args.fail_rate,
            seed,
        },
    )
    .await
    .map_err(|e| format!("cannot start the proxy: {e}"))?;
    let account = args
        .account
        .clone()
        .unwrap_or_else(|| format!("acct_cli_{}", uuid::Uuid::new_v4().simple()));
    let attempts = attempts_for(args.fail_rate, args.count);
    // Sized so that every operation can use all its attempts: each attempt's timeout plus
    // the longest wait, and a server's `Retry-After` (a 409 says 1 s), per attempt.
    let deadline = (ATTEMPT_TIMEOUT + MAX_WAIT + RETRY_AFTER_ALLOWANCE) * attempts;
    let client = reqwest_middleware::ClientBuilder::new(
        reqwest::Client::builder()
            // One exchange per connection, so each attempt meets its own fate at the proxy.
            .pool_max_idle_per_host(0)
            .timeout(ATTEMPT_TIMEOUT)
            .build()
            .map_err(|e| e.to_string())?,
    )
    .with(
        IdempotentRetry::builder()
            .max_attempts(attempts)
            .backoff(MIN_WAIT, MAX_WAIT)
            .deadline(deadline)
            .build(),
    )
    .build();
    let charges = format!("http://{}/v1/charges", proxy.addr());

    let bar = ProgressBar::with_draw_target(Some(args.count as u64), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} charges {elapsed}") {
        bar.set_style(style);
    }
    let started = Instant::now();
    let failures: Vec<String> = futures_util::stream::iter(0..args.count)
        .map(|i| {
            let (client, charges, account, bar) = (&client, &charges, &account, &bar);
            async move {
                let body = format!(
                    r#"{{"amount": {}, "currency": "usd", "customer": "cus_{i}"}}"#,
                    100 + i
                );
                let res = client
                    .post(charges.clone())
                    .bearer_auth(account)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                bar.inc(1);
                match res {
                    Ok(r) if r.status().as_u16() == 201 => None,
                    Ok(r) => Some(format!("charge {i}: HTTP {}", r.status())),
                    Err(e) => Some(format!("charge {i}: {e}")),
                }
            }
        })
        .buffer_unordered(args.concurrency.max(1))
        .filter_map(std::future::ready)
        .collect()
        .await;
    bar.finish_and_clear();
    let elapsed = started.elapsed();

    let stats = proxy.stats();
    let mut out = std::io::stdout().lock();
    for failure in &failures {
        let _ = writeln!(out, "failed: {failure}");
    }
    let _ = writeln!(
        out,
        "sent {} charges in {:.1} s: {} attempts, up to {attempts} each (seed {seed})",
        args.count,
        elapsed.as_secs_f64(),
        stats.connections.load(Ordering::Relaxed),
    );
    let _ = writeln!(
        out,
        "dropped {} requests before the server and {} responses after it answered",
        stats.dropped_requests.load(Ordering::Relaxed),
        stats.dropped_responses.load(Ordering::Relaxed),
    );
    // Counted on the server directly, not through the proxy.
    let list = base
        .join("/v1/charges")
        .map_err(|e| format!("bad --url: {e}"))?;
    let held = reqwest::Client::new()
        .get(list)
        .bearer_auth(&account)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| format!("cannot list the charges: {e}"))?
        .json::<serde_json::Value>()
        .await
        .map_err(|e| format!("cannot list the charges: {e}"))?["data"]
        .as_array()
        .map_or(0, Vec::len);
    let _ = writeln!(out, "charges on {account}: {held}");
    let _ = out.flush();
    Ok(failures.is_empty() && held == args.count)
}
