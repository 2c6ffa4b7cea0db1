//! Writes orders, each with its payment event in the outbox in the same transaction, then
//! relays the outbox to a RabbitMQ queue, at least once (see `idempotent_examples::outbox`).
//!
//! `cargo run -p idempotent-examples --bin orders-producer -- --count 100`

use clap::Parser;
use idempotent_examples::outbox::{self, PaymentEvent};
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use std::process::ExitCode;

/// Orders and their events, through the outbox, to RabbitMQ.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// PostgreSQL (default `$DATABASE_URL`).
    #[arg(long)]
    database: Option<String>,
    /// RabbitMQ.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    amqp: String,
    /// The queue (durable) the events go to.
    #[arg(long, default_value = "payments")]
    queue: String,
    /// How many orders to write.
    #[arg(long, default_value_t = 100)]
    count: usize,
    /// The tenant of the orders (default: a new one).
    #[arg(long)]
    tenant: Option<String>,
    /// Publish every N-th outbox row twice, as a relay that crashed between publishing and
    /// marking the row does (0: never).
    #[arg(long, default_value_t = 0)]
    duplicate_every: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("orders-producer: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let pool = outbox::connect(args.database.as_deref(), 4).await?;
    let tenant = args
        .tenant
        .clone()
        .unwrap_or_else(|| format!("tenant_{}", uuid::Uuid::new_v4().simple()));

    // The order and its event in one transaction: both or neither.
    for i in 0..args.count {
        let order = format!("ord_{}", uuid::Uuid::new_v4().simple());
        let event = PaymentEvent {
            id: format!("evt_{}", uuid::Uuid::new_v4().simple()),
            tenant: tenant.clone(),
            order: order.clone(),
            amount: 100 + i64::try_from(i).unwrap_or(0),
        };
        let payload = serde_json::to_string(&event).map_err(|e| e.to_string())?;
        let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
        sqlx::query("INSERT INTO outbox_example.orders (id, tenant, amount) VALUES ($1, $2, $3)")
            .bind(&order)
            .bind(&tenant)
            .bind(event.amount)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        sqlx::query("INSERT INTO outbox_example.outbox (destination, event_id, payload) VALUES ($1, $2, $3)")
            .bind(&args.queue)
            .bind(&event.id)
            .bind(&payload)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
    }

    let (conn, channel) = outbox::channel(&args.amqp, &args.queue).await?;
    // Publisher confirms: a row is marked published only after the broker has it.
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let (mut published, mut duplicates) = (0u64, 0u64);
    loop {
        // A batch of unpublished rows, locked so two relays never take the same rows.
        let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
        let rows: Vec<(i64, String)> = sqlx::query_as(
            "SELECT seq, payload FROM outbox_example.outbox WHERE destination = $1 AND published_at IS NULL
             ORDER BY seq LIMIT 100 FOR UPDATE SKIP LOCKED",
        )
        .bind(&args.queue)
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
        if rows.is_empty() {
            break;
        }
        let mut seqs = Vec::with_capacity(rows.len());
        for (seq, payload) in &rows {
            let times = if args.duplicate_every > 0
                && u64::try_from(*seq)
                    .unwrap_or(0)
                    .is_multiple_of(args.duplicate_every)
            {
                duplicates += 1;
                2
            } else {
                1
            };
            for _ in 0..times {
                let confirm = channel
                    .basic_publish(
                        "".into(),
                        args.queue.as_str().into(),
                        // Mandatory: a message no queue takes comes back, not acked.
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        payload.as_bytes(),
                        BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_content_type("application/json".into()),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                // Only an ack with nothing returned means the queue has it; anything else
                // leaves the row unpublished (the batch rolls back and is relayed again).
                let confirmation = confirm.await.map_err(|e| e.to_string())?;
                if !confirmation.is_ack() || confirmation.take_message().is_some() {
                    return Err(format!("the broker did not take event row {seq}"));
                }
                published += 1;
            }
            seqs.push(*seq);
        }
        // Marked only after the broker confirmed: a crash before this line publishes the
        // batch again (at least once).
        sqlx::query("UPDATE outbox_example.outbox SET published_at = now() WHERE seq = ANY($1)")
            .bind(&seqs)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
    }
    let _ = conn.close(200, "done".into()).await;
    println!(
        "wrote {} orders for {tenant}; published {published} messages ({duplicates} duplicate publishes)",
        args.count
    );
    Ok(())
}
