//! The outbox pair on a real broker (RabbitMQ, 127.0.0.1:5672) and PostgreSQL, as real
//! processes: `orders-producer` publishes N events (some twice, as an at-least-once relay
//! does), two `payments-consumer`s take them at once, one nacks some first deliveries and is
//! then killed with SIGKILL in the middle of a message and restarted. Each kind of
//! redelivery is shown to have happened, and the bookings are exactly N, one per event.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running consumer whose stdout lines are collected; killed on drop.
struct Consumer {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Consumer {
    fn start(queue: &str, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_payments-consumer"))
            .args(["--queue", queue])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in out.lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        let c = Consumer { child, lines };
        c.wait_for("to start consuming", |l| l.iter().any(|x| x == "consuming"));
        c
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    fn count(&self, prefix: &str) -> usize {
        self.lines()
            .iter()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    fn wait_for(&self, what: &str, done: impl Fn(&[String]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done(&self.lines()) {
            assert!(
                Instant::now() < deadline,
                "consumer never got {what}: {:?}",
                self.lines()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

async fn bookings(pool: &sqlx::PgPool, tenant: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), count(DISTINCT event_id) FROM outbox_example.bookings WHERE tenant = $1",
    )
    .bind(tenant)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Runs a command to its end within `limit` (a broker under an alarm blocks publishers: fail
/// rather than hang); its stdout.
fn run_bounded(cmd: &mut Command, limit: Duration) -> String {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{cmd:?} did not finish in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{cmd:?}: {out}{err}");
    out
}

/// The number before `word` in `text` (`published 220 messages` → 220 for `messages`).
fn number_before(text: &str, word: &str) -> usize {
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .windows(2)
        .find(|w| w[1].trim_start_matches('(') == word || w[1] == word)
        .and_then(|w| w[0].trim_start_matches('(').parse().ok())
        .unwrap_or_else(|| panic!("no number before `{word}` in {text:?}"))
}

#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_event_is_booked_once_under_redelivery() {
    const N: i64 = 200;
    let url = std::env::var("DATABASE_URL").unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let run = uuid::Uuid::new_v4().simple().to_string();
    let (queue, tenant) = (format!("payments_{run}"), format!("tenant_{run}"));

    // Two consumers at once; the first nacks every 5th first delivery and works slowly
    // enough to be killed in the middle of a booking. The others leave once idle.
    let doomed = Consumer::start(
        &queue,
        &["--nack-every", "5", "--work-delay", "300ms", "--announce"],
    );
    let idle = ["--exit-when-idle", "3s", "--announce"];
    let steady = Consumer::start(&queue, &[&["--work-delay", "10ms"][..], &idle].concat());

    let said = run_bounded(
        Command::new(env!("CARGO_BIN_EXE_orders-producer"))
            .args([
                "--queue",
                &queue,
                "--tenant",
                &tenant,
                "--count",
                &N.to_string(),
            ])
            .args(["--duplicate-every", "10"]),
        Duration::from_secs(120),
    );
    let published = number_before(&said, "messages");
    let duplicates = number_before(&said, "duplicate");

    // SIGKILL the first consumer right after it starts a booking (inside its transaction):
    // it has nacked a message by then, and holds unacked ones the broker hands back.
    doomed.wait_for("a few bookings and a nack", |l| {
        l.iter().filter(|x| x.starts_with("working ")).count() >= 5
            && l.iter().any(|x| x.starts_with("nack "))
    });
    let before = doomed.count("working ");
    doomed.wait_for("another booking to start", |l| {
        l.iter().filter(|x| x.starts_with("working ")).count() > before
    });
    let mut doomed = doomed;
    doomed.child.kill().unwrap();
    doomed.child.wait().unwrap();
    let doomed_lines = doomed.lines();
    let cut: Vec<String> = doomed_lines
        .iter()
        .filter_map(|l| l.strip_prefix("working "))
        .filter(|id| !doomed_lines.contains(&format!("acked {id}")))
        .map(str::to_owned)
        .collect();
    let mut restarted = Consumer::start(&queue, &idle);

    // Every event booked, then every message taken (both remaining consumers went idle).
    let deadline = Instant::now() + Duration::from_secs(120);
    while bookings(&pool, &tenant).await.0 < N {
        assert!(
            Instant::now() < deadline,
            "stuck at {:?}",
            bookings(&pool, &tenant).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut steady = steady;
    for c in [&mut steady, &mut restarted] {
        while c.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "a consumer never went idle");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(
        bookings(&pool, &tenant).await,
        (N, N),
        "exactly one booking per event"
    );

    let others: Vec<String> = [steady.lines(), restarted.lines()].concat();
    let all: Vec<String> = [doomed_lines.clone(), others.clone()].concat();
    let acked = all.iter().filter(|l| l.starts_with("acked ")).count();
    // Every message published (duplicates included) was taken and acked exactly once: the
    // duplicates were answered from their records, since the bookings are N.
    assert_eq!(acked, published, "acks vs messages published");
    assert_eq!(published, usize::try_from(N).unwrap() + duplicates);
    // A duplicate publish arrived: one event delivered fresh twice.
    let mut fresh: Vec<&str> = all
        .iter()
        .filter_map(|l| {
            l.strip_prefix("delivery ")?
                .strip_suffix(" redelivered=false")
        })
        .collect();
    fresh.sort_unstable();
    let twice = fresh.windows(2).filter(|w| w[0] == w[1]).count();
    // Each nack came back as a redelivery.
    let nacked: Vec<&str> = doomed_lines
        .iter()
        .filter_map(|l| l.strip_prefix("nack "))
        .collect();
    for id in &nacked {
        assert!(
            all.contains(&format!("delivery {id} redelivered=true")),
            "nacked {id} never came back"
        );
    }
    // The booking the kill cut was rolled back and done again by another consumer.
    for id in &cut {
        assert!(
            others.contains(&format!("working {id}")),
            "the cut booking {id} was not redone"
        );
    }
    let redelivered = all
        .iter()
        .filter(|l| l.ends_with("redelivered=true"))
        .count();
    println!(
        "published {published} ({duplicates} duplicate publishes, {twice} delivered twice), nacks {}, bookings cut by the kill {}, redeliveries {redelivered}; acked: killed {}, steady {}, restarted {}",
        nacked.len(),
        cut.len(),
        doomed_lines
            .iter()
            .filter(|l| l.starts_with("acked "))
            .count(),
        steady.count("acked "),
        restarted.count("acked "),
    );
    assert!(
        duplicates > 0 && twice > 0,
        "no duplicate publish reached a consumer"
    );
    assert!(!nacked.is_empty(), "no nack");
    assert!(!cut.is_empty(), "the kill did not land inside a booking");
    assert!(steady.count("acked ") > 0 && doomed_lines.iter().any(|l| l.starts_with("acked ")));

    // Leave no queue behind.
    let amqp = "amqp://guest:guest@127.0.0.1:5672/%2f";
    let (conn, channel) = idempotent_examples::outbox::channel(amqp, &queue)
        .await
        .unwrap();
    channel
        .queue_delete(
            queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
}
