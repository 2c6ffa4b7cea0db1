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
    sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM bookings WHERE tenant = $1")
        .bind(tenant)
        .fetch_one(pool)
        .await
        .unwrap()
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
    // enough to be killed in the middle of a message.
    let doomed = Consumer::start(
        &queue,
        &["--nack-every", "5", "--work-delay", "300ms", "--announce"],
    );
    let steady = Consumer::start(&queue, &["--work-delay", "10ms", "--announce"]);

    let produced = Command::new(env!("CARGO_BIN_EXE_orders-producer"))
        .args([
            "--queue",
            &queue,
            "--tenant",
            &tenant,
            "--count",
            &N.to_string(),
        ])
        .args(["--duplicate-every", "10"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&produced.stdout).into_owned();
    assert!(
        produced.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&produced.stderr)
    );
    let duplicates: usize = said
        .split('(')
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();

    // SIGKILL the first consumer right after it starts a booking (inside its transaction):
    // it has nacked some messages by then, and holds unacked ones the broker hands back.
    doomed.wait_for("a few bookings and nacks", |l| {
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
    let cut = doomed_lines
        .iter()
        .filter_map(|l| l.strip_prefix("working "))
        .filter(|id| !doomed_lines.contains(&format!("acked {id}")))
        .count();
    let restarted = Consumer::start(&queue, &["--work-delay", "10ms"]);

    // Every event booked; then a while longer, in case a redelivery were booked again.
    let deadline = Instant::now() + Duration::from_secs(120);
    while bookings(&pool, &tenant).await.0 < N {
        assert!(
            Instant::now() < deadline,
            "stuck at {:?}",
            bookings(&pool, &tenant).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        bookings(&pool, &tenant).await,
        (N, N),
        "exactly one booking per event"
    );

    let all: Vec<String> = [doomed_lines.clone(), steady.lines(), restarted.lines()].concat();
    let redelivered = all
        .iter()
        .filter(|l| l.ends_with("redelivered=true"))
        .count();
    let nacks = doomed_lines
        .iter()
        .filter(|l| l.starts_with("nack "))
        .count();
    println!(
        "duplicate publishes {duplicates}, nacks {nacks}, bookings cut by the kill {cut}, redeliveries {redelivered}; acked: killed {}, steady {}, restarted {}",
        doomed_lines
            .iter()
            .filter(|l| l.starts_with("acked "))
            .count(),
        steady.count("acked "),
        restarted.count("acked "),
    );
    assert!(duplicates > 0, "the relay published nothing twice");
    assert!(nacks > 0, "no nack");
    assert!(cut > 0, "the kill did not land inside a booking");
    assert!(
        redelivered >= nacks + cut,
        "fewer redeliveries than nacks and cut bookings"
    );
    assert!(steady.count("acked ") > 0 && doomed_lines.iter().any(|l| l.starts_with("acked ")));
}
