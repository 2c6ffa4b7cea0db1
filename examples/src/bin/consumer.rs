//! A queue consumer in function mode: `#[idempotent(key_from = …)]` on the async fn that
//! handles a message makes it run once per (tenant, message id), whatever the queue
//! redelivers; a redelivery gets the first run's output back without running the body. The
//! queue here is an in-process channel fed with deliberate duplicates (no broker needed);
//! `payments-consumer` is the same on RabbitMQ and PostgreSQL.
//!
//! `cargo run -p idempotent-examples --bin consumer`

use idempotent_core::call::{CallError, Calls};
use idempotent_core::{Engine, MemoryStore, idempotent};
use serde::Serialize;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A message as the broker delivers it (at least once).
#[derive(Debug, Clone, Serialize)]
struct Message {
    id: String,
    tenant: String,
    amount: i64,
}

/// Bodies run (to show that redeliveries run none).
static RUNS: AtomicUsize = AtomicUsize::new(0);

/// Charges one invoice. The record's identity is `name`; the key is the message id, the scope
/// its tenant (one tenant's ids never meet another's); the message's JSON is the fingerprint.
#[idempotent(name = "charge_invoice", key_from = "msg.id", scope = "msg.tenant")]
async fn charge_invoice(calls: &Calls, msg: &Message) -> Result<String, std::io::Error> {
    let run = RUNS.fetch_add(1, Ordering::SeqCst) + 1;
    println!("ran {}/{} (run {run})", msg.tenant, msg.id);
    Ok(format!(
        "receipt {run}: {} charged {}",
        msg.tenant, msg.amount
    ))
}

fn message(tenant: &str, id: &str, amount: i64) -> Message {
    let (id, tenant) = (id.to_owned(), tenant.to_owned());
    Message { id, tenant, amount }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let calls = Calls::new(Engine::new(MemoryStore::new()));
    let (queue, mut deliveries) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        // At-least-once delivery: evt_1 and evt_2 come twice, evt_1 of another tenant is a
        // message of its own, and the last is evt_2's id reused for another payload.
        let sent = [
            message("acme", "evt_1", 500),
            message("acme", "evt_2", 700),
            message("acme", "evt_1", 500),
            message("globex", "evt_1", 500),
            message("acme", "evt_2", 700),
            message("acme", "evt_2", 999),
        ];
        for msg in sent {
            let _ = queue.send(msg).await;
        }
    });
    let (mut handled, mut replayed, mut refused) = (0, 0, 0);
    while let Some(msg) = deliveries.recv().await {
        let runs_before = RUNS.load(Ordering::SeqCst);
        let (what, count) = match charge_invoice(&calls, &msg).await {
            // The stored output of the first run; the body did not run.
            Ok(receipt) if RUNS.load(Ordering::SeqCst) == runs_before => {
                (format!("replayed ({receipt})"), &mut replayed)
            }
            Ok(receipt) => (format!("handled ({receipt})"), &mut handled),
            // The id reused for other contents: a real consumer dead-letters it.
            Err(CallError::Mismatch) => ("refused (other contents)".to_owned(), &mut refused),
            // Another consumer has it, or the store failed: a real consumer nacks it for later.
            Err(e) => return Err(e.into()),
        };
        *count += 1;
        println!("{}/{}: {what}", msg.tenant, msg.id);
    }
    let runs = RUNS.load(Ordering::SeqCst);
    println!("{handled} handled, {replayed} replayed, {refused} refused; {runs} runs");
    Ok(())
}
