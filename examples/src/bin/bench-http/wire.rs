//! A TCP proxy between benchmark servers and PostgreSQL that counts what the servers send:
//! statements (Execute messages of the extended protocol, plus simple Query messages) and
//! round trips (writes from the client that hold a Sync or a Query message: the client
//! then waits for the server's ReadyForQuery; messages sent together in one write, such as a
//! queued ROLLBACK and the Sync after it, wait once). sqlx's pool pings a connection when it
//! goes back to the pool with a bare Sync: a round trip, not a statement. Connect through it
//! with `sslmode=disable`, so the messages are readable.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The counts since the proxy started.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) statements: AtomicU64,
    pub(crate) round_trips: AtomicU64,
}

impl Counts {
    pub(crate) fn read(&self) -> (u64, u64) {
        (
            self.statements.load(Ordering::Relaxed),
            self.round_trips.load(Ordering::Relaxed),
        )
    }
}

/// Starts the proxy to `upstream` on a free port of 127.0.0.1.
pub(crate) async fn start(upstream: SocketAddr) -> std::io::Result<(SocketAddr, Arc<Counts>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let counts = Arc::new(Counts::default());
    let shared = counts.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let counts = shared.clone();
            tokio::spawn(async move {
                if let Ok(server) = TcpStream::connect(upstream).await {
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    relay(client, server, counts).await;
                }
            });
        }
    });
    Ok((addr, counts))
}

async fn relay(client: TcpStream, server: TcpStream, counts: Arc<Counts>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async move {
        let mut parser = Frontend::default();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            parser.feed(&buf[..n], &counts);
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    };
    tokio::join!(upstream, downstream);
}

/// Splits the client's byte stream into protocol messages: the first (startup, SSL or GSS
/// request) has no type byte; every later one is a type byte and a big-endian length that
/// counts itself.
#[derive(Default)]
struct Frontend {
    started: bool,
    header: Vec<u8>,
    skip: usize,
}

impl Frontend {
    /// Parses one read from the client (one write of its, as the client sets no delay and
    /// then waits for the answer).
    fn feed(&mut self, mut bytes: &[u8], counts: &Counts) {
        let mut waits = false;
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(bytes.len());
                self.skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let header_len = if self.started { 5 } else { 4 };
            let n = (header_len - self.header.len()).min(bytes.len());
            self.header.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.header.len() < header_len {
                continue;
            }
            let len_at = header_len - 4;
            let mut len = [0u8; 4];
            len.copy_from_slice(&self.header[len_at..]);
            let len = u32::from_be_bytes(len) as usize;
            if self.started {
                match self.header[0] {
                    b'E' => {
                        counts.statements.fetch_add(1, Ordering::Relaxed);
                    }
                    b'Q' => {
                        counts.statements.fetch_add(1, Ordering::Relaxed);
                        waits = true;
                    }
                    b'S' => waits = true,
                    _ => {}
                }
            } else if len != 8 {
                // The startup message (an 8-byte message is an SSL or GSS request: another
                // untyped message follows).
                self.started = true;
            }
            self.skip = len.saturating_sub(4);
            self.header.clear();
        }
        if waits {
            counts.round_trips.fetch_add(1, Ordering::Relaxed);
        }
    }
}
