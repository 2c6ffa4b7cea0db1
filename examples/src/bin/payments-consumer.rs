//! Consumes payment events from RabbitMQ with manual acks and books each one through an
//! idempotent function in transactional mode: the booking row and the processed-message
//! record commit together, so redeliveries book nothing twice (see
//! `idempotent_examples::outbox`).
//!
//! `cargo run -p idempotent-examples --bin payments-consumer`

use clap::Parser;
use futures_util::StreamExt;
use idempotent_core::call::{CallError, Calls};
use idempotent_core::sqlx::Postgres;
use idempotent_core::{Engine, PostgresStore, Transaction, idempotent};
use idempotent_examples::outbox::{self, Booking, PaymentEvent};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Books payment events, once each, whatever the broker redelivers.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// PostgreSQL (default `$DATABASE_URL`): the bookings and the idempotency records.
    #[arg(long)]
    database: Option<String>,
    /// RabbitMQ.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    amqp: String,
    /// The queue to consume.
    #[arg(long, default_value = "payments")]
    queue: String,
    /// Nack (with requeue) the first delivery of every N-th message: a redelivery on demand
    /// (0: never).
    #[arg(long, default_value_t = 0)]
    nack_every: u64,
    /// How long booking takes, inside its transaction (a test kills the consumer there).
    #[arg(long, default_value = "0ms", value_parser = idempotent_examples::charges::parse_delay)]
    work_delay: Duration,
    /// Print `working <event>` when a booking is inside its transaction.
    #[arg(long)]
    announce: bool,
    /// Book without the idempotent function (BEGIN, INSERT, COMMIT, ack): the baseline of
    /// the throughput figures, which books a redelivered message twice.
    #[arg(long)]
    plain: bool,
    /// Exit after this long without a message (0: run until killed).
    #[arg(long, default_value = "0ms", value_parser = idempotent_examples::charges::parse_delay)]
    exit_when_idle: Duration,
    /// Messages in flight from the broker (prefetch).
    #[arg(long, default_value_t = 16)]
    prefetch: u16,
}

/// How a booking behaves (the example's knobs).
struct Work {
    delay: Duration,
    announce: bool,
}

/// Books one payment: runs at most once per (tenant, event id), and its row commits with
/// the record of having run.
#[idempotent(
    name = "book_payment",
    key_from = "event.id",
    scope = "event.tenant",
    ttl = "7d",
    lease = "10s"
)]
async fn book_payment(
    calls: &Calls,
    mut tx: Transaction<Postgres>,
    event: &PaymentEvent,
    // The example's knobs, no input of the booking: left out of the fingerprint.
    #[idempotent(skip)] work: &Work,
) -> Result<Booking, sqlx::Error> {
    let booking: i64 = sqlx::query_scalar(
        "INSERT INTO outbox_example.bookings (event_id, tenant, amount) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(&event.id)
    .bind(&event.tenant)
    .bind(event.amount)
    .fetch_one(&mut *tx)
    .await?;
    if work.announce {
        say(&format!("working {}", event.id));
    }
    if !work.delay.is_zero() {
        tokio::time::sleep(work.delay).await;
    }
    Ok(Booking {
        booking,
        event: event.id.clone(),
    })
}

/// The baseline: the same row, no idempotency.
async fn book_plain(pool: &sqlx::PgPool, event: &PaymentEvent) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO outbox_example.bookings (event_id, tenant, amount) VALUES ($1, $2, $3)",
    )
    .bind(&event.id)
    .bind(&event.tenant)
    .bind(event.amount)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Hands a delivery back to the broker, which redelivers it (to this or another consumer).
async fn requeue(delivery: &lapin::message::Delivery) -> Result<(), String> {
    delivery
        .nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        })
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("payments-consumer: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let pool = outbox::connect(args.database.as_deref(), 8).await?;
    let store = PostgresStore::new(pool.clone()).map_err(|e| e.to_string())?;
    store.migrate().await.map_err(|e| e.to_string())?;
    let calls = Calls::new(Engine::new(store));
    let work = Work {
        delay: args.work_delay,
        announce: args.announce,
    };

    let (conn, channel) = outbox::channel(&args.amqp, &args.queue).await?;
    channel
        .basic_qos(args.prefetch, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut consumer = channel
        .basic_consume(
            args.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    say("consuming");

    let (mut consumed, mut first_seen, mut last_done) = (0u64, None::<Instant>, Instant::now());
    let mut fresh = 0u64;
    loop {
        let next = if args.exit_when_idle.is_zero() {
            consumer.next().await
        } else {
            match tokio::time::timeout(args.exit_when_idle, consumer.next()).await {
                Ok(next) => next,
                Err(_) => break,
            }
        };
        let Some(delivery) = next else {
            // The broker cancelled the consumer (its queue deleted, a failover).
            return Err("the broker ended the consumer".to_owned());
        };
        let delivery = delivery.map_err(|e| e.to_string())?;
        first_seen.get_or_insert_with(Instant::now);
        let event: PaymentEvent = match serde_json::from_slice(&delivery.data) {
            Ok(event) => event,
            Err(e) => {
                // Never valid: drop it rather than redeliver it forever.
                eprintln!("payments-consumer: dropping an undecodable message: {e}");
                let _ = delivery
                    .nack(BasicNackOptions {
                        requeue: false,
                        ..BasicNackOptions::default()
                    })
                    .await;
                continue;
            }
        };
        say(&format!(
            "delivery {} redelivered={}",
            event.id, delivery.redelivered
        ));
        if !delivery.redelivered && args.nack_every > 0 {
            fresh += 1;
            if fresh.is_multiple_of(args.nack_every) {
                say(&format!("nack {}", event.id));
                requeue(&delivery).await?;
                continue;
            }
        }
        let booked = if args.plain {
            book_plain(&pool, &event).await.map_err(|e| e.to_string())
        } else {
            match book_payment(&calls, &event, &work).await {
                Ok(_) => Ok(()),
                // Another consumer has it right now, or the database failed: hand it back
                // for later.
                Err(
                    e @ (CallError::InProgress { .. }
                    | CallError::Store(_)
                    | CallError::Draining
                    | CallError::Failed(_)),
                ) => Err(e.to_string()),
                // Never going to work (the id reused for another payload, an invalid id or
                // tenant, a stored record of another shape): drop it rather than loop on it.
                // A real consumer sends it to a dead-letter exchange here.
                Err(e) => {
                    say(&format!("drop {} ({e})", event.id));
                    delivery
                        .nack(BasicNackOptions {
                            requeue: false,
                            ..BasicNackOptions::default()
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    continue;
                }
            }
        };
        match booked {
            Ok(()) => {
                delivery
                    .ack(BasicAckOptions::default())
                    .await
                    .map_err(|e| e.to_string())?;
                say(&format!("acked {}", event.id));
                consumed += 1;
                last_done = Instant::now();
            }
            Err(why) => {
                say(&format!("requeue {} ({why})", event.id));
                tokio::time::sleep(Duration::from_millis(50)).await;
                requeue(&delivery).await?;
            }
        }
    }
    let secs = first_seen.map_or(0.0, |t| last_done.duration_since(t).as_secs_f64());
    say(&format!(
        "consumed {consumed} messages in {secs:.2} s: {:.0} messages/s",
        if secs > 0.0 {
            consumed as f64 / secs
        } else {
            0.0
        }
    ));
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}
