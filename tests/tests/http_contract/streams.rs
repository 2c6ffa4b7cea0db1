//! Streamed responses: stored and replayed within the limit, 410 over it, released when they
//! break before they could be stored, not held back when slow, read on when the client leaves;
//! an endless stream whose client left, and a client that stops reading while it stays
//! connected (TCP and a Unix socket), are bounded by the lease.

use crate::{App, Fw, Server, actix_app, axum_app, config, key, problem, serve};
use idempotent_core::MemoryStore;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Whether the response broke off (or was a 409 while a release is pending): the client
/// sees a broken stream as a failed request or a failed body, depending on when it broke.
async fn broken_stream(req: reqwest::RequestBuilder) -> bool {
    match req.send().await {
        Err(_) => true,
        Ok(res) if res.status() == 409 => true,
        Ok(res) => res.bytes().await.is_err(),
    }
}

pub(crate) async fn streamed_responses(s: &Server) {
    let text = "text/plain";
    // Within the limit: streamed, stored, replayed byte for byte.
    let before = s.runs();
    let k = key();
    let first = s.raw_post("/stream/ok", &k, text, "").send().await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    assert_eq!(first.text().await.unwrap(), "chunk-1;chunk-2;chunk-3");
    let replay = s
        .until_not_busy(|| s.raw_post("/stream/ok", &k, text, ""))
        .await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), "chunk-1;chunk-2;chunk-3");
    assert_eq!(s.runs() - before, 1);

    // Over the limit: the client gets it all; the retry gets 410 and nothing runs again.
    let before = s.runs();
    let k = key();
    let big = s
        .raw_post("/stream/big", &k, text, "")
        .send()
        .await
        .unwrap();
    assert_eq!(big.text().await.unwrap().len(), 100);
    let gone = s
        .until_not_busy(|| s.raw_post("/stream/big", &k, text, ""))
        .await;
    problem(gone, 410, "idempotency-response-not-stored").await;
    assert_eq!(s.runs() - before, 1);

    // Fails before it could be stored: nothing stored, the key released, the retry runs.
    let before = s.runs();
    let k = key();
    assert!(broken_stream(s.raw_post("/stream/fails-early", &k, text, "")).await);
    for _ in 0..200 {
        if s.runs() - before == 2 {
            break;
        }
        // A 409 while the release is on its way; then the retry runs (and breaks) again.
        assert!(broken_stream(s.raw_post("/stream/fails-early", &k, text, "")).await);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(s.runs() - before, 2, "released: the retry ran again");

    // Fails after the oversized marker: the marker stays (the handler ran).
    let before = s.runs();
    let k = key();
    assert!(broken_stream(s.raw_post("/stream/fails-late", &k, text, "")).await);
    let gone = s
        .until_not_busy(|| s.raw_post("/stream/fails-late", &k, text, ""))
        .await;
    problem(gone, 410, "idempotency-response-not-stored").await;
    assert_eq!(s.runs() - before, 1);

    // A slow stream is not held back: the first chunk arrives while the handler still waits.
    let before = s.runs();
    let k = key();
    let mut slow = s
        .raw_post("/stream/gate", &k, text, "")
        .send()
        .await
        .unwrap();
    let chunk = tokio::time::timeout(Duration::from_secs(5), slow.chunk())
        .await
        .expect("the first chunk came before the stream ended")
        .unwrap()
        .unwrap();
    assert_eq!(&chunk[..], b"first;");
    let busy = s
        .raw_post("/stream/gate", &k, text, "")
        .send()
        .await
        .unwrap();
    problem(busy, 409, "idempotency-key-in-progress").await;
    s.app.gate.notify_one();
    assert_eq!(slow.chunk().await.unwrap().unwrap(), "second");
    let replay = s
        .until_not_busy(|| s.raw_post("/stream/gate", &k, text, ""))
        .await;
    assert_eq!(replay.text().await.unwrap(), "first;second");

    // The client leaves mid-stream: the rest is read on the server and stored.
    let k = key();
    let mut left = s
        .raw_post("/stream/gate", &k, text, "")
        .send()
        .await
        .unwrap();
    assert_eq!(left.chunk().await.unwrap().unwrap(), "first;");
    drop(left);
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.app.gate.notify_one();
    let replay = s
        .until_not_busy(|| s.raw_post("/stream/gate", &k, text, ""))
        .await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), "first;second");
    assert_eq!(s.runs() - before, 2, "one run per key");
}

/// An endless stream whose client left is read on for at most the route's lease, then stored
/// as not replayable (410) and dropped: the key does not stay in progress for good.
pub(crate) async fn an_endless_stream_whose_client_left_is_bounded(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    let k = key();
    let mut res = s
        .raw_post("/stream/endless", &k, "text/plain", "")
        .send()
        .await
        .unwrap();
    assert_eq!(res.chunk().await.unwrap().unwrap(), "tick;");
    drop(res);
    let gone = s
        .until_not_busy(|| s.raw_post("/stream/endless", &k, "text/plain", ""))
        .await;
    problem(gone, 410, "idempotency-response-not-stored").await;
    assert_eq!(s.runs(), 1);
    let drained = s.engine.drain(Duration::from_secs(5)).await;
    assert_eq!(drained.still_running, 0);
}

/// Issue 49 (3): a client that reads a streamed response's head and then stops reading, while
/// staying connected, must not hold its key in progress for as long as its connection lives.
/// Once the buffers between them are full the server stops polling the body, so the body's
/// own lease of silence is never checked; the execution's heartbeat sees that nothing has
/// moved for a lease and stores the "not stored" marker, and a retry gets 410. On TCP and on
/// a Unix socket, in small and large chunks, from a handler that answers at once and from one
/// that takes more than half its lease (whose heartbeat started before the body was watched).
/// Before the fix the heartbeat kept renewing and every retry got 409 for as long as the
/// connection stayed open.
pub(crate) async fn a_client_that_stops_reading_never_holds_its_key(fw: Fw) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("idempotent.sock");
    let tcp = serve(fw, config(MemoryStore::new())).await;
    let app = App::default();
    match fw {
        Fw::Axum => axum_app::serve_unix(config(MemoryStore::new()), &app, &socket).await,
        Fw::Actix => actix_app::serve_unix(config(MemoryStore::new()), &app, &socket),
    }
    // (transport, chunk size, how long the handler takes before it answers: past half the
    // lease, its heartbeat has started before the body is watched)
    let cases = [
        (false, 16, 0),
        (false, 65_536, 0),
        (true, 16, 0),
        (true, 65_536, 0),
        (false, 16, 300),
        (true, 65_536, 300),
    ];
    for (unix, size, delay) in cases {
        {
            let k = key();
            let body = format!("{size} {delay}");
            let request = format!(
                "POST /stream/flood HTTP/1.1\r\nhost: x\r\nidempotency-key: {k}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let connect = || async {
                if unix {
                    Conn::Unix(tokio::net::UnixStream::connect(&socket).await.unwrap())
                } else {
                    Conn::Tcp(tokio::net::TcpStream::connect(tcp.addr).await.unwrap())
                }
            };
            // The client that stops reading after the head (and staying connected).
            let mut stalled = connect().await;
            stalled.write_all(request.as_bytes()).await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0_u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = stalled.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before the head");
                head.extend_from_slice(&buf[..n]);
            }
            assert!(
                head.starts_with(b"HTTP/1.1 200"),
                "{}",
                String::from_utf8_lossy(&head)
            );
            // Retries: 409 while the stream is recorded, then 410 (not stored, never again run).
            let started = std::time::Instant::now();
            let answer = loop {
                let mut retry = connect().await;
                retry.write_all(request.as_bytes()).await.unwrap();
                let answer = retry.read_answer().await;
                if !answer.starts_with("HTTP/1.1 409") {
                    break answer;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "unix {unix}, chunks of {size}: still in progress after {:?} (20 leases)",
                    started.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            assert!(
                answer.starts_with("HTTP/1.1 410"),
                "unix {unix}, {size}: {answer}"
            );
            assert!(
                answer.contains("idempotency-response-not-stored"),
                "{answer}"
            );
            drop(stalled);
        }
    }
    assert_eq!(
        tcp.runs() + app.runs.load(Ordering::SeqCst),
        cases.len(),
        "one run per key"
    );
}

/// A client connection on TCP or a Unix socket.
enum Conn {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Conn {
    async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Conn::Tcp(c) => c.write_all(bytes).await,
            Conn::Unix(c) => c.write_all(bytes).await,
        }
    }
    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(c) => c.read(buf).await,
            Conn::Unix(c) => c.read(buf).await,
        }
    }
    /// An answer as text: the whole of one with a `content-length` (a problem), the head of
    /// any other (a stream, which is not read on).
    async fn read_answer(&mut self) -> String {
        let mut out = Vec::new();
        let mut buf = [0_u8; 4096];
        loop {
            let n = self.read(&mut buf).await.unwrap();
            out.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&out).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len = head.lines().find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                });
                match len {
                    Some(len) if body.len() < len.trim().parse::<usize>().unwrap() => {}
                    Some(_) => return text,
                    None => return head.to_owned(),
                }
            }
            assert!(n > 0, "closed mid-answer: {text}");
        }
    }
}
