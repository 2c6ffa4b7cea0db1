//! A small TCP proxy on 127.0.0.1 that loses a share of HTTP/1.1 exchanges: some requests
//! before they reach the server, some responses after the server has written them in full
//! (the server did the work; the client never hears of it). It is how `charges-client` shows
//! that retries with one key per operation end with exactly one charge per operation.
//!
//! One exchange per connection: point a client at it that does not reuse connections
//! (`reqwest::ClientBuilder::pool_max_idle_per_host(0)`), so each attempt is a connection of
//! its own and meets its own fate.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What happens to one connection's exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Forwarded both ways.
    Pass,
    /// The request's head is read, then the connection is closed: the server never sees it.
    DropRequest,
    /// The request reaches the server and its whole response is read from it; then the
    /// client's connection is closed without a byte of that response.
    DropResponse,
}

/// How fates are drawn.
#[derive(Debug, Clone)]
pub enum Drops {
    /// Each connection: a request drop with probability `rate / 2`, a response drop with
    /// probability `rate / 2`, from a generator seeded with `seed`.
    Random {
        /// Share of exchanges lost, in `[0, 1)`.
        rate: f64,
        /// Seed of the draws (the same seed gives the same sequence of fates).
        seed: u64,
    },
    /// The fates in order, then again from the start (deterministic tests).
    Cycle(Vec<Fate>),
}

/// What the proxy did.
#[derive(Debug, Default)]
pub struct Stats {
    /// Connections accepted (one per attempt).
    pub connections: AtomicU64,
    /// Requests closed before reaching the server.
    pub dropped_requests: AtomicU64,
    /// Responses the server wrote that the client never got.
    pub dropped_responses: AtomicU64,
}

/// A running proxy; it stops when dropped.
#[derive(Debug)]
pub struct DroppingProxy {
    addr: SocketAddr,
    stats: Arc<Stats>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for DroppingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How long the proxy waits for a request head or a response before it gives up on the
/// connection (the server's handler may be slow; the client's own timeout decides).
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(60);

/// Largest head (request or response) read when parsing.
const MAX_HEAD: usize = 64 * 1024;

impl DroppingProxy {
    /// Listens on 127.0.0.1 (a free port) and forwards to `upstream`.
    ///
    /// # Errors
    /// When it cannot listen.
    pub async fn start(upstream: SocketAddr, drops: Drops) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(Stats::default());
        let fates = Arc::new(Mutex::new(Fates::new(drops)));
        let task = tokio::spawn({
            let stats = stats.clone();
            async move {
                // The exchanges in flight: dropped (so aborted) with the proxy.
                let mut exchanges = tokio::task::JoinSet::new();
                loop {
                    while exchanges.try_join_next().is_some() {}
                    let client = match listener.accept().await {
                        Ok((client, _)) => client,
                        Err(_) => {
                            // Out of descriptors, say: wait rather than spin.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    };
                    stats.connections.fetch_add(1, Ordering::Relaxed);
                    let fate = fates.lock().unwrap_or_else(|e| e.into_inner()).next();
                    let stats = stats.clone();
                    exchanges.spawn(async move {
                        let _ = tokio::time::timeout(
                            EXCHANGE_TIMEOUT,
                            exchange(client, upstream, fate, &stats),
                        )
                        .await;
                    });
                }
            }
        });
        Ok(DroppingProxy { addr, stats, task })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it did so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }
}

struct Fates {
    drops: Drops,
    rng: fastrand::Rng,
    at: usize,
}

impl Fates {
    fn new(drops: Drops) -> Self {
        let seed = match &drops {
            Drops::Random { seed, .. } => *seed,
            Drops::Cycle(_) => 0,
        };
        Fates {
            drops,
            rng: fastrand::Rng::with_seed(seed),
            at: 0,
        }
    }

    fn next(&mut self) -> Fate {
        match &self.drops {
            Drops::Random { rate, .. } => {
                let x = self.rng.f64();
                if x < rate / 2.0 {
                    Fate::DropRequest
                } else if x < *rate {
                    Fate::DropResponse
                } else {
                    Fate::Pass
                }
            }
            Drops::Cycle(fates) => {
                let fate = fates.get(self.at % fates.len().max(1)).copied();
                self.at += 1;
                fate.unwrap_or(Fate::Pass)
            }
        }
    }
}

async fn exchange(
    mut client: TcpStream,
    upstream: SocketAddr,
    fate: Fate,
    stats: &Stats,
) -> io::Result<()> {
    match fate {
        Fate::Pass => {
            let mut server = TcpStream::connect(upstream).await?;
            tokio::io::copy_bidirectional(&mut client, &mut server).await?;
        }
        Fate::DropRequest => {
            // Let the client send its head, so it is a request that was lost, not a refused
            // connection; then close without forwarding a byte.
            let mut head = Vec::new();
            read_head(&mut client, &mut head).await?;
            stats.dropped_requests.fetch_add(1, Ordering::Relaxed);
        }
        Fate::DropResponse => {
            let server = TcpStream::connect(upstream).await?;
            let (mut from_server, mut to_server) = server.into_split();
            let (mut from_client, _to_client) = client.split();
            // The request goes through as it arrives; the response is read in full and lost.
            let forward = async {
                let mut buf = [0u8; 8192];
                loop {
                    let n = from_client.read(&mut buf).await?;
                    if n == 0 {
                        break;
                    }
                    to_server.write_all(&buf[..n]).await?;
                }
                std::future::pending::<io::Result<()>>().await
            };
            let whole = read_response(&mut from_server);
            tokio::select! {
                read = whole => {
                    read?;
                    stats.dropped_responses.fetch_add(1, Ordering::Relaxed);
                }
                failed = forward => failed?,
            }
            // Dropping both halves closes the client's connection: it gets no response.
        }
    }
    Ok(())
}

/// Reads until the end of an HTTP head (`\r\n\r\n`); returns where the body starts.
async fn read_head<R: AsyncReadExt + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> io::Result<usize> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = find(buf, b"\r\n\r\n") {
            return Ok(end + 4);
        }
        if buf.len() > MAX_HEAD {
            return Err(io::Error::other("head too large"));
        }
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Reads one whole HTTP/1.1 response: its head, then a `Content-Length` body or a chunked
/// one (to its last chunk), or to the end of the stream when it has neither.
async fn read_response<R: AsyncReadExt + Unpin>(r: &mut R) -> io::Result<()> {
    let mut buf = Vec::new();
    let body_start = read_head(r, &mut buf).await?;
    let head = String::from_utf8_lossy(&buf[..body_start]).to_ascii_lowercase();
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
    };
    let mut chunk = [0u8; 8192];
    if let Some(len) = header("content-length:").and_then(|v| v.parse::<usize>().ok()) {
        let mut have = buf.len() - body_start;
        while have < len {
            let n = r.read(&mut chunk).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            have += n;
        }
        return Ok(());
    }
    let chunked = header("transfer-encoding:").is_some_and(|v| v.contains("chunked"));
    let mut body = buf.split_off(body_start);
    loop {
        if chunked && (body.starts_with(b"0\r\n\r\n") || find(&body, b"\r\n0\r\n\r\n").is_some()) {
            return Ok(());
        }
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return if chunked {
                Err(io::ErrorKind::UnexpectedEof.into())
            } else {
                Ok(())
            };
        }
        body.extend_from_slice(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn random_fates_follow_the_rate_and_the_seed() {
        let draw = |seed| {
            let mut f = Fates::new(Drops::Random { rate: 0.3, seed });
            (0..10_000).map(|_| f.next()).collect::<Vec<_>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
        let count = |fate| a.iter().filter(|f| **f == fate).count();
        assert!(
            (1_300..1_700).contains(&count(Fate::DropRequest)),
            "{}",
            count(Fate::DropRequest)
        );
        assert!(
            (1_300..1_700).contains(&count(Fate::DropResponse)),
            "{}",
            count(Fate::DropResponse)
        );
        let mut c = Fates::new(Drops::Cycle(vec![Fate::DropRequest, Fate::Pass]));
        assert_eq!(
            [c.next(), c.next(), c.next()],
            [Fate::DropRequest, Fate::Pass, Fate::DropRequest]
        );
    }
}
