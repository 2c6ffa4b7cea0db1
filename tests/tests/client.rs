//! The client retry middleware (`idempotent_client`) against a scripted HTTP server on
//! 127.0.0.1: one key per logical request, kept across retries; what is retried and what is
//! not; `Retry-After`, attempts and the deadline; lost and truncated responses.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_client::{
    DeadlineExceeded, IdempotentRetry, IdempotentRetryBuilder, KeyFormat, UsedKey,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the server does with one connection (one request each: the client keeps none).
#[derive(Clone)]
enum Act {
    /// Answers with this status, extra header lines and body.
    Answer(u16, &'static str, &'static str),
    /// Reads the request, then closes without a byte: a lost response.
    Close,
    /// Announces 10 bytes, sends 2, closes: a body cut short.
    Truncate,
    /// Waits, then answers 201.
    Slow(Duration),
    /// Answers 201 with this many bytes of body, chunked (no length declared); with `true`,
    /// closes instead of sending the last chunk: a long body cut short.
    Long(usize, bool),
}

/// A server that plays `script` (then answers 201 forever) and records each request's
/// `Idempotency-Key` (or `None`).
struct Scripted {
    url: String,
    keys: Arc<Mutex<Vec<Option<String>>>>,
}

impl Scripted {
    async fn start(script: Vec<Act>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/op", listener.local_addr().unwrap());
        let keys = Arc::new(Mutex::new(Vec::new()));
        let seen = keys.clone();
        tokio::spawn(async move {
            let mut script = script.into_iter();
            loop {
                let (mut conn, _) = listener.accept().await.unwrap();
                let act = script.next().unwrap_or(Act::Answer(201, "", "done"));
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = conn.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    head.extend_from_slice(&buf[..n]);
                }
                let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
                let key = text
                    .lines()
                    .find_map(|l| l.strip_prefix("idempotency-key:"))
                    .map(|v| v.trim().to_owned());
                seen.lock().unwrap().push(key);
                if let Act::Long(n, cut) = act {
                    let _ = conn
                        .write_all(b"HTTP/1.1 201 X\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
                        .await;
                    let piece = vec![b'x'; 64 * 1024];
                    let mut left = n;
                    while left > 0 {
                        let len = left.min(piece.len());
                        let chunk = format!("{len:x}\r\n");
                        let _ = conn.write_all(chunk.as_bytes()).await;
                        let _ = conn.write_all(&piece[..len]).await;
                        let _ = conn.write_all(b"\r\n").await;
                        left -= len;
                    }
                    if !cut {
                        let _ = conn.write_all(b"0\r\n\r\n").await;
                    }
                    drop(conn);
                    continue;
                }
                let answer = |status: u16, extra: &str, body: &str| {
                    format!(
                        "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
                        body.len()
                    )
                };
                let out = match act {
                    Act::Answer(status, extra, body) => answer(status, extra, body),
                    Act::Close => String::new(),
                    Act::Truncate => {
                        "HTTP/1.1 201 X\r\ncontent-length: 10\r\nconnection: close\r\n\r\nok"
                            .to_owned()
                    }
                    Act::Slow(d) => {
                        tokio::time::sleep(d).await;
                        answer(201, "", "slow")
                    }
                    Act::Long(..) => unreachable!("answered above"),
                };
                let _ = conn.write_all(out.as_bytes()).await;
                drop(conn);
            }
        });
        Scripted { url, keys }
    }

    /// A POST through the middleware built from `retry`.
    async fn post(&self, retry: IdempotentRetryBuilder) -> reqwest::Response {
        client(retry.build()).post(&self.url).send().await.unwrap()
    }

    fn keys(&self) -> Vec<Option<String>> {
        self.keys.lock().unwrap().clone()
    }
}

fn client(retry: IdempotentRetry) -> reqwest_middleware::ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap(),
    )
    .with(retry)
    .build()
}

fn fast() -> IdempotentRetryBuilder {
    IdempotentRetry::builder()
        .backoff(Duration::from_millis(1), Duration::from_millis(20))
        .max_attempts(6)
        .deadline(Duration::from_secs(20))
}

#[tokio::test]
async fn one_generated_key_survives_every_kind_of_retry() {
    let s = Scripted::start(vec![
        Act::Close,
        Act::Truncate,
        Act::Answer(503, "", "down"),
        Act::Answer(409, "retry-after: 0\r\n", "busy"),
        Act::Answer(429, "", "slow down"),
        Act::Answer(201, "", "charged"),
    ])
    .await;
    let res = client(fast().build())
        .post(&s.url)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let used = res.extensions().get::<UsedKey>().cloned().unwrap();
    assert_eq!(
        res.url().as_str(),
        s.url,
        "the rebuilt response keeps its URL"
    );
    assert_eq!(res.text().await.unwrap(), "charged");
    let keys = s.keys();
    assert_eq!(keys.len(), 6);
    let first = keys[0].clone().unwrap();
    assert!(uuid::Uuid::parse_str(&first).is_ok(), "{first}");
    assert!(
        keys.iter().all(|k| k.as_deref() == Some(first.as_str())),
        "{keys:?}"
    );
    assert_eq!(used.0, first);
    // Two logical requests: two keys.
    let again = s.post(fast()).await;
    assert_ne!(again.extensions().get::<UsedKey>().unwrap().0, first);
}

#[tokio::test]
async fn the_callers_key_is_kept_and_sf_strings_can_be_asked_for() {
    let s = Scripted::start(vec![Act::Close, Act::Answer(201, "", "ok")]).await;
    let res = client(fast().build())
        .post(&s.url)
        .header("Idempotency-Key", "order-42")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(
        s.keys(),
        [Some("order-42".to_owned()), Some("order-42".to_owned())]
    );
    let s = Scripted::start(vec![]).await;
    client(fast().key_format(KeyFormat::SfString).build())
        .patch(&s.url)
        .send()
        .await
        .unwrap();
    let key = s.keys()[0].clone().unwrap();
    assert!(
        key.starts_with('"') && key.ends_with('"') && key.len() == 38,
        "{key}"
    );
}

#[tokio::test]
async fn client_errors_are_never_retried() {
    for status in [400, 401, 403, 404, 410, 422] {
        let s = Scripted::start(vec![Act::Answer(status, "", "no")]).await;
        let res = s.post(fast()).await;
        assert_eq!(res.status().as_u16(), status);
        assert_eq!(s.keys().len(), 1, "{status} was retried");
    }
}

#[tokio::test]
async fn attempts_are_bounded_and_the_last_answer_is_returned() {
    let s = Scripted::start(vec![Act::Answer(503, "", "down"); 10]).await;
    let res = s.post(fast().max_attempts(3)).await;
    assert_eq!(res.status(), 503);
    assert_eq!(res.text().await.unwrap(), "down");
    assert_eq!(s.keys().len(), 3);
    // Lost responses only: the last error comes back after the last attempt.
    let s = Scripted::start(vec![Act::Close; 10]).await;
    let err = client(fast().max_attempts(4).build())
        .post(&s.url)
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(err, reqwest_middleware::Error::Reqwest(_)),
        "{err}"
    );
    assert_eq!(s.keys().len(), 4);
}

#[tokio::test]
async fn retry_after_is_a_floor_and_a_long_one_ends_the_retries() {
    let s = Scripted::start(vec![Act::Answer(429, "retry-after: 1\r\n", "wait")]).await;
    let started = Instant::now();
    let res = s.post(fast()).await;
    assert_eq!(res.status(), 201);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After was not honoured"
    );
    // Asking for more than `max_retry_after`: the 503 comes back at once.
    let s = Scripted::start(vec![Act::Answer(503, "retry-after: 120\r\n", "later")]).await;
    let res = s.post(fast().max_retry_after(Duration::from_secs(5))).await;
    assert_eq!(res.status(), 503);
    assert_eq!(s.keys().len(), 1);
    // A wait that would pass the deadline is not started either.
    let s = Scripted::start(vec![Act::Answer(409, "retry-after: 3\r\n", "busy")]).await;
    let res = s.post(fast().deadline(Duration::from_secs(1))).await;
    assert_eq!(res.status(), 409);
    assert_eq!(s.keys().len(), 1);
}

#[tokio::test]
async fn the_deadline_bounds_an_attempt_in_flight() {
    let s = Scripted::start(vec![Act::Slow(Duration::from_secs(5))]).await;
    let started = Instant::now();
    let err = client(fast().deadline(Duration::from_millis(300)).build())
        .post(&s.url)
        .send()
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    match err {
        reqwest_middleware::Error::Middleware(e) => assert!(e.is::<DeadlineExceeded>(), "{e}"),
        other => panic!("{other}"),
    }
}

#[tokio::test]
async fn safe_methods_get_no_key_and_streams_one_attempt() {
    let s = Scripted::start(vec![Act::Answer(503, "", "down")]).await;
    let res = client(fast().build()).get(&s.url).send().await.unwrap();
    assert_eq!(res.status(), 201);
    assert!(res.extensions().get::<UsedKey>().is_none());
    assert_eq!(s.keys(), [None, None]);
    // A streamed body cannot be sent twice: one attempt, still with a key.
    let s = Scripted::start(vec![Act::Answer(503, "", "down")]).await;
    let stream = futures_util::stream::iter([Ok::<_, std::io::Error>("chunk")]);
    let res = client(fast().build())
        .post(&s.url)
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(s.keys().len(), 1);
    assert!(s.keys()[0].is_some());
}

#[tokio::test]
async fn stored_answers_and_absurd_waits_end_the_retries() {
    // A stored 5xx (a route that stores server errors) is the same on every retry.
    let s = Scripted::start(vec![Act::Answer(
        500,
        "idempotent-replayed: true\r\n",
        "stored",
    )])
    .await;
    let res = s.post(fast()).await;
    assert_eq!(res.status(), 500);
    assert_eq!(s.keys().len(), 1);
    // A `Retry-After` past what the clock can hold: no panic, the answer comes back.
    let s = Scripted::start(vec![Act::Answer(
        503,
        "retry-after: 18446744073709551615\r\n",
        "never",
    )])
    .await;
    let res = s.post(fast().max_retry_after(Duration::MAX)).await;
    assert_eq!(res.status(), 503);
    assert_eq!(s.keys().len(), 1);
    // No deadline at all: the attempts still bound it.
    let s = Scripted::start(vec![Act::Answer(503, "", "down"); 5]).await;
    let res = s.post(fast().deadline(Duration::MAX).max_attempts(3)).await;
    assert_eq!(res.status(), 503);
    assert_eq!(s.keys().len(), 3);
}

/// Buffering holds at most `max_buffered` bytes of a body (default 8 MiB): a longer body is
/// handed on whole as it streams, and a cut in it past that point is the caller's error, not
/// an attempt again (which would have buffered it all first).
#[tokio::test]
async fn buffering_is_bounded_and_a_long_body_arrives_whole() {
    let big = idempotent_client::DEFAULT_MAX_BUFFERED + 1024 * 1024;
    // Whole, past the default bound: every byte arrives, in one attempt.
    let server = Scripted::start(vec![Act::Long(big, false)]).await;
    let res = client(IdempotentRetry::builder().build())
        .post(&server.url)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let body = res.bytes().await.unwrap();
    assert_eq!(body.len(), big);
    assert!(body.iter().all(|&b| b == b'x'));
    assert_eq!(server.keys.lock().unwrap().len(), 1);
    // Cut past the bound: not read to the end inside the middleware, so not retried; the
    // caller sees the cut.
    let server = Scripted::start(vec![Act::Long(big, true)]).await;
    let res = client(IdempotentRetry::builder().build())
        .post(&server.url)
        .send()
        .await
        .unwrap();
    assert!(res.bytes().await.is_err(), "the cut reaches the caller");
    assert_eq!(server.keys.lock().unwrap().len(), 1, "no second attempt");
    // A small bound of its own; a cut inside it is still retried.
    let server = Scripted::start(vec![Act::Long(100, true), Act::Long(100, false)]).await;
    let res = client(IdempotentRetry::builder().max_buffered(1024).build())
        .post(&server.url)
        .send()
        .await
        .unwrap();
    assert_eq!(res.bytes().await.unwrap().len(), 100);
    assert_eq!(server.keys.lock().unwrap().len(), 2);
}

/// The client names the headers as the server side does (the client crate depends on no
/// server crate, so each defines its own).
#[test]
fn the_client_and_the_server_name_the_same_headers() {
    assert_eq!(
        idempotent_client::IDEMPOTENCY_KEY.as_str(),
        idempotent_core::http::IDEMPOTENCY_KEY
    );
    assert_eq!(
        idempotent_client::IDEMPOTENT_REPLAYED,
        idempotent_core::http::IDEMPOTENT_REPLAYED
    );
}
