//! A TCP proxy on 127.0.0.1 that stalls chosen connections: nothing more moves either way on
//! a stalled connection, which stays open (a process frozen, a network lost, a half-open
//! connection nobody resets). Two triggers:
//! - [`StallingProxy::arm`] (PostgreSQL): the first connection that sends `COMMIT` (alone,
//!   or in a batch such as the library's complete and COMMIT) stalls, and the `COMMIT` never
//!   reaches the server; [`StallingProxy::arm_on`] does the same for other bytes;
//! - [`StallingProxy::freeze_open`] (any protocol): every connection open now stalls at the
//!   next bytes it sends, which never reach the server; connections opened later pass.
//!
//! Every other connection passes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy; it stops (and closes every connection) when dropped.
#[derive(Debug)]
pub struct StallingProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug, Default)]
struct Shared {
    /// The byte strings that stall the next connection sending one of them, once.
    armed: std::sync::Mutex<Option<Vec<Vec<u8>>>>,
    stalled: AtomicU64,
    /// Connections are numbered from 1 as they are accepted.
    accepted: AtomicU64,
    /// Every connection numbered up to this stalls at its next send.
    frozen_up_to: AtomicU64,
    /// Set when the proxy is dropped: stalled connections close.
    closed: tokio::sync::Notify,
}

impl Drop for StallingProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.closed.notify_waiters();
    }
}

/// `COMMIT` ending a simple-query message (as sqlx sends it) or a statement of a batch.
const COMMITS: [&[u8]; 2] = [b"COMMIT\0", b"COMMIT;"];

impl StallingProxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `upstream`.
    ///
    /// # Panics
    /// When it cannot listen.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let shared = Arc::new(Shared::default());
        let accepting = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let id = accepting.accepted.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::spawn(forward(client, server, id, Arc::clone(&accepting)));
            }
        });
        StallingProxy { addr, shared, task }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stalls the next connection that sends `COMMIT`.
    pub fn arm(&self) {
        *self.shared.armed.lock().expect("lock") =
            Some(COMMITS.iter().map(|c| c.to_vec()).collect());
    }

    /// Stalls the next connection that sends `bytes` (in one message or across two reads);
    /// they never reach the server.
    pub fn arm_on(&self, bytes: &[u8]) {
        *self.shared.armed.lock().expect("lock") = Some(vec![bytes.to_vec()]);
    }

    /// Stalls every connection open now at the next bytes it sends (they never reach the
    /// server, and nothing more comes back); connections opened after this pass.
    pub fn freeze_open(&self) {
        let accepted = self.shared.accepted.load(Ordering::SeqCst);
        self.shared
            .frozen_up_to
            .fetch_max(accepted, Ordering::SeqCst);
    }

    /// How many connections it has stalled.
    pub fn stalled(&self) -> u64 {
        self.shared.stalled.load(Ordering::SeqCst)
    }
}

async fn forward(client: TcpStream, server: TcpStream, id: u64, shared: Arc<Shared>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let stall = tokio::sync::Notify::new();
    let up = async {
        let mut buf = vec![0_u8; 16 * 1024];
        // The last bytes of the previous chunk, so a COMMIT split across reads is seen.
        let mut tail: Vec<u8> = Vec::new();
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let mut window = std::mem::take(&mut tail);
            window.extend_from_slice(&buf[..n]);
            let (caught, longest) = {
                let mut armed = shared.armed.lock().expect("lock");
                let longest = armed.iter().flatten().map(Vec::len).max().unwrap_or(0);
                let seen = armed
                    .iter()
                    .flatten()
                    .any(|p| !p.is_empty() && window.windows(p.len()).any(|w| w == p.as_slice()));
                if seen {
                    *armed = None;
                }
                (seen, longest)
            };
            if caught || id <= shared.frozen_up_to.load(Ordering::SeqCst) {
                shared.stalled.fetch_add(1, Ordering::SeqCst);
                stall.notify_one();
                // Held open, forwarding nothing, until the proxy goes.
                return std::future::pending::<()>().await;
            }
            if sw.write_all(&buf[..n]).await.is_err() {
                return;
            }
            tail = window[window.len().saturating_sub(longest.max(COMMITS[0].len()))..].to_vec();
        }
    };
    let down = async {
        let mut buf = vec![0_u8; 16 * 1024];
        loop {
            let n = tokio::select! {
                read = sr.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                },
                // Stalled: read nothing more from the server (its answers, or its closing
                // the session, never reach the client).
                () = stall.notified() => return std::future::pending::<()>().await,
            };
            if cw.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = up => {}
        () = down => {}
        () = shared.closed.notified() => {}
    }
}
