//! `#[idempotent]` on plain async functions (`Calls`): the shapes it accepts.

use idempotent_core::call::{CallError, Calls, StoredError};
use idempotent_core::{Idempotent, Transaction, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Serialize)]
struct PaymentEvent {
    id: String,
    tenant: String,
    seq: u64,
    amount: i64,
}

#[derive(Debug, Serialize, Deserialize)]
enum BookError {
    Declined,
    Unavailable,
}

impl StoredError for BookError {
    fn is_stored(&self) -> bool {
        matches!(self, BookError::Declined)
    }
}

/// Key from a field, scope from a field, a derived key, errors stored when final.
#[idempotent(
    name = "book_payment",
    key_from = "msg.id",
    scope = "msg.tenant",
    ttl = "7d",
    store_errors
)]
pub async fn book_payment(
    calls: &Calls,
    idem: &Idempotent,
    msg: &PaymentEvent,
) -> Result<String, BookError> {
    if msg.amount < 0 {
        return Err(BookError::Declined);
    }
    Ok(format!("{} {}", idem.derive("ledger"), msg.amount))
}

/// An integer key, unscoped, owned message, `?` inside, a wait for duplicates.
#[idempotent(
    name = "by-sequence.v1",
    key_from = "msg.seq",
    unscoped,
    wait = "5s",
    lease = "10s"
)]
async fn by_sequence(msg: PaymentEvent, calls: &Calls) -> Result<u64, std::io::Error> {
    let n: u64 = "7".parse().map_err(std::io::Error::other)?;
    Ok(msg.seq + n)
}

/// Transactional: the record commits with the function's writes.
#[idempotent(name = "book_in_tx", key_from = "msg.id", scope = "msg.tenant")]
async fn book_in_tx(
    calls: &Calls,
    mut tx: Transaction<sqlx::Postgres>,
    msg: &PaymentEvent,
) -> Result<i64, sqlx::Error> {
    sqlx::query("INSERT INTO bookings (id) VALUES ($1)")
        .bind(&msg.id)
        .execute(&mut *tx)
        .await?;
    Ok(msg.amount)
}

/// Through an adapter's attribute: `key_from` switches it to function mode.
mod through_axum {
    // Everything from the adapter alone.
    use idempotent_axum::call::Calls;
    use idempotent_axum::idempotent;

    #[idempotent(name = "axum.plain", key_from = "id", unscoped)]
    pub async fn plain(calls: &Calls, id: &str) -> Result<(), String> {
        let _ = id;
        Ok(())
    }
}

mod through_actix {
    use idempotent_actix::call::Calls;
    use idempotent_actix::idempotent;

    #[idempotent(name = "actix.plain", key_from = "id", unscoped)]
    pub async fn plain(calls: &Calls, id: u64) -> Result<(), String> {
        let _ = id;
        Ok(())
    }
}

/// A handle the function uses but that is no input of the operation (and not `Serialize`).
struct Ledger;

/// The note of a payment, destructured in the signature.
#[derive(Serialize)]
struct Note {
    text: String,
    private: String,
}

/// The key in a parameter of its own, the message's contents in others: every input is
/// fingerprinted (the bindings of a destructured one, a gated one where it exists), except
/// the scope and what is marked `#[idempotent(skip)]`.
#[idempotent(name = "book_by_id", key_from = "id", scope = "tenant")]
async fn book_by_id(
    calls: &Calls,
    id: u64,
    tenant: &str,
    amount: i64,
    Note { text, .. }: Note,
    #[cfg(any())] absent: Absent,
    #[idempotent(skip)] ledger: &Ledger,
) -> Result<String, std::io::Error> {
    let _ = ledger;
    Ok(format!("{id} {tenant} {amount} {text}"))
}

/// Exists in no configuration this is built in.
#[cfg(any())]
struct Absent;

async fn callers(calls: &Calls, msg: PaymentEvent) {
    let a: Result<String, CallError<BookError>> = book_payment(calls, &msg).await;
    let b: Result<i64, CallError<sqlx::Error>> = book_in_tx(calls, &msg).await;
    let c: Result<(), CallError<String>> = through_axum::plain(calls, "k").await;
    let d = through_actix::plain(calls, 7).await;
    let e: Result<u64, CallError<std::io::Error>> = by_sequence(msg, calls).await;
    let note = Note {
        text: "gift".into(),
        private: String::new(),
    };
    let _ = &note.private;
    let f = book_by_id(calls, 7, "t1", 5, note, &Ledger).await;
    drop((a, b, c, d, e, f));
}

fn main() {
    let _ = callers;
}
