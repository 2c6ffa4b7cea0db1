//! The load generator: keep-alive HTTP/1.1 connections on one thread, written directly on
//! tokio's TCP (a request is a few hundred bytes written and read, so the generator costs far
//! less CPU per request than the server it measures). Each connection sends a request, reads
//! the whole response (`Content-Length` framing; anything else is an error), records the
//! latency, and sends the next, until the deadline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What a run sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    /// A new key per request.
    First,
    /// Keys from a fixed set finished before the run.
    Replay,
    /// Alternately a new key and a finished one.
    Mix,
    /// Connections in groups of 8 send the same sequence of keys in step (a barrier before
    /// each key), so each key arrives 8 times at the same moment.
    Dup8,
}

impl Scenario {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::First => "first executions",
            Self::Replay => "replays",
            Self::Mix => "50/50 mix",
            Self::Dup8 => "8 concurrent duplicates",
        }
    }
}

/// Keys finished before a replay run.
pub(crate) const REPLAY_KEYS: usize = 256;

/// The outcome of one run.
#[derive(Debug, Default)]
pub(crate) struct Sample {
    /// 2xx answers.
    pub(crate) ok: u64,
    /// 2xx answers to requests with a new key (first executions and mix).
    pub(crate) fresh_ok: u64,
    /// Keys sent (for 8 duplicates: each group's keys once).
    pub(crate) distinct_keys: u64,
    /// 409 answers (a duplicate of a request still running).
    pub(crate) conflicts: u64,
    /// Anything else, including I/O errors.
    pub(crate) errors: u64,
    /// The first error, to show.
    pub(crate) first_error: Option<String>,
    /// Latency of every answered request, in microseconds.
    pub(crate) latencies_us: Vec<u32>,
    pub(crate) elapsed: Duration,
}

impl Sample {
    pub(crate) fn answered(&self) -> u64 {
        self.ok + self.conflicts
    }

    pub(crate) fn per_second(&self) -> f64 {
        self.answered() as f64 / self.elapsed.as_secs_f64()
    }

    /// The `q` quantile of latency (0.0–1.0), in microseconds.
    pub(crate) fn quantile_us(&mut self, q: f64) -> u32 {
        if self.latencies_us.is_empty() {
            return 0;
        }
        self.latencies_us.sort_unstable();
        let at = ((self.latencies_us.len() - 1) as f64 * q).round() as usize;
        self.latencies_us[at]
    }

    fn merge(&mut self, other: Sample) {
        self.ok += other.ok;
        self.fresh_ok += other.fresh_ok;
        self.conflicts += other.conflicts;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.latencies_us.extend(other.latencies_us);
    }
}

/// The request body for the `n`th operation (a retry of an operation sends the same body).
fn body(n: u64) -> String {
    format!(
        r#"{{"amount":{},"currency":"usd","description":"Order {n} placed by the HTTP benchmark","metadata":{{"customer":"cus_{:08x}","channel":"web","items":"{}","note":"gift wrap, leave at the door"}}}}"#,
        100 + n % 10_000,
        n.wrapping_mul(2_654_435_761) & 0xffff_ffff,
        1 + n % 7
    )
}

fn request(key: &str, n: u64) -> Vec<u8> {
    let body = body(n);
    format!(
        "POST /v1/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer acct_bench\r\n\
         Content-Type: application/json\r\nIdempotency-Key: {key}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// One keep-alive connection.
pub(crate) struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub(crate) async fn open(addr: SocketAddr) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream,
            buf: Vec::with_capacity(4096),
        })
    }

    /// Sends `req` and reads the answer: its status and body.
    pub(crate) async fn send(&mut self, req: &[u8]) -> Result<(u16, Vec<u8>), String> {
        self.stream
            .write_all(req)
            .await
            .map_err(|e| e.to_string())?;
        self.buf.clear();
        let head_end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            self.fill().await?;
        };
        let head = std::str::from_utf8(&self.buf[..head_end]).map_err(|e| e.to_string())?;
        let status: u16 = head
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line: {head:?}"))?;
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())?
            })
            .ok_or_else(|| format!("no Content-Length in {head:?}"))?;
        while self.buf.len() < head_end + length {
            self.fill().await?;
        }
        Ok((status, self.buf[head_end..head_end + length].to_vec()))
    }

    async fn fill(&mut self) -> Result<(), String> {
        let mut chunk = [0u8; 4096];
        let n = self
            .stream
            .read(&mut chunk)
            .await
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("connection closed".to_owned());
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

/// `GET /stats`: how many times the server's handler ran.
pub(crate) async fn executions(addr: SocketAddr) -> Result<u64, String> {
    let mut conn = Conn::open(addr).await.map_err(|e| e.to_string())?;
    let (status, body) = conn
        .send(b"GET /stats HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let text = String::from_utf8_lossy(&body);
    if status != 200 {
        return Err(format!("GET /stats: {status} {text}"));
    }
    text.trim()
        .parse()
        .map_err(|_| format!("GET /stats: {text:?}"))
}

/// Finishes the keys a replay run sends (`ns` names the key set); returns how many answered 2xx.
pub(crate) async fn seed_replays(addr: SocketAddr, ns: &str) -> Result<u64, String> {
    let mut conn = Conn::open(addr).await.map_err(|e| e.to_string())?;
    let mut ok = 0;
    for k in 0..REPLAY_KEYS as u64 {
        let (status, body) = conn.send(&request(&format!("r-{ns}-{k}"), k)).await?;
        if !(200..300).contains(&status) {
            return Err(format!(
                "seeding a replay key: {status} {}",
                String::from_utf8_lossy(&body)
            ));
        }
        ok += 1;
    }
    Ok(ok)
}

/// Drives `connections` connections against `addr` for `duration`. Keys of new operations are
/// unique to `ns`; replayed keys are those [`seed_replays`] finished under `replay_ns`.
pub(crate) async fn run(
    addr: SocketAddr,
    scenario: Scenario,
    ns: &str,
    replay_ns: &str,
    connections: usize,
    duration: Duration,
) -> Sample {
    let start = Instant::now();
    let deadline = start + duration;
    let mut workers = tokio::task::JoinSet::new();
    // For 8 duplicates: per group of 8 connections, a barrier and the decision to stop, which
    // the group takes together (a connection that stopped alone would leave the others
    // waiting).
    let groups: Vec<_> = (0..connections.div_ceil(8))
        .map(|g| {
            let size = (connections - g * 8).min(8);
            (
                Arc::new(tokio::sync::Barrier::new(size)),
                Arc::new(AtomicBool::new(false)),
            )
        })
        .collect();
    for worker in 0..connections as u64 {
        let group = (scenario == Scenario::Dup8).then(|| groups[worker as usize / 8].clone());
        let ns = ns.to_owned();
        let replay_ns = replay_ns.to_owned();
        workers.spawn(async move {
            let mut sample = Sample::default();
            let mut conn = match Conn::open(addr).await {
                Ok(c) => c,
                Err(e) => {
                    sample.errors += 1;
                    sample.first_error = Some(e.to_string());
                    return (worker, sample);
                }
            };
            let mut n: u64 = 0;
            loop {
                match &group {
                    Some((barrier, stop)) => {
                        let step = async {
                            if barrier.wait().await.is_leader() {
                                stop.store(Instant::now() >= deadline, Ordering::Relaxed);
                            }
                            barrier.wait().await;
                        };
                        if tokio::time::timeout(Duration::from_secs(10), step)
                            .await
                            .is_err()
                        {
                            sample.errors += 1;
                            sample.first_error.get_or_insert_with(|| {
                                "a duplicate's group stopped answering".to_owned()
                            });
                            break;
                        }
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                    None if Instant::now() >= deadline => break,
                    None => {}
                }
                let replayed = |i: u64| {
                    let k = (worker * 31 + i) % REPLAY_KEYS as u64;
                    (format!("r-{replay_ns}-{k}"), k)
                };
                let fresh = matches!(scenario, Scenario::First)
                    || (scenario == Scenario::Mix && n.is_multiple_of(2));
                let (key, body_n) = match scenario {
                    Scenario::First => (format!("f-{ns}-{worker}-{n}"), n),
                    Scenario::Replay => replayed(n),
                    Scenario::Mix if n.is_multiple_of(2) => (format!("f-{ns}-{worker}-{n}"), n),
                    Scenario::Mix => replayed(n),
                    Scenario::Dup8 => (format!("d-{ns}-{}-{n}", worker / 8), n),
                };
                let req = request(&key, body_n);
                let sent = Instant::now();
                match conn.send(&req).await {
                    Ok((status, body)) => {
                        let us = sent.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                        match status {
                            200..=299 => {
                                sample.ok += 1;
                                sample.fresh_ok += u64::from(fresh);
                                sample.latencies_us.push(us);
                            }
                            409 => {
                                sample.conflicts += 1;
                                sample.latencies_us.push(us);
                            }
                            _ => {
                                sample.errors += 1;
                                sample.first_error.get_or_insert_with(|| {
                                    format!("{status} {}", String::from_utf8_lossy(&body))
                                });
                            }
                        }
                    }
                    Err(e) => {
                        sample.errors += 1;
                        sample.first_error.get_or_insert(e);
                        match Conn::open(addr).await {
                            Ok(c) => conn = c,
                            Err(_) => {
                                sample.distinct_keys = n + 1;
                                return (worker, sample);
                            }
                        }
                    }
                }
                n += 1;
            }
            sample.distinct_keys = n;
            (worker, sample)
        });
    }
    let mut total = Sample::default();
    // Keys sent per worker; for 8 duplicates, the group's workers share theirs.
    let mut keys = std::collections::BTreeMap::new();
    while let Some(done) = workers.join_next().await {
        if let Ok((worker, sample)) = done {
            let group = if scenario == Scenario::Dup8 {
                worker / 8
            } else {
                worker
            };
            let sent = keys.entry(group).or_insert(0);
            *sent = sample.distinct_keys.max(*sent);
            total.merge(sample);
        } else {
            total.errors += 1;
        }
    }
    total.distinct_keys = keys.values().sum();
    total.elapsed = start.elapsed();
    total
}
