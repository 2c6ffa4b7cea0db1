//! The transactional outbox and an idempotent consumer, on PostgreSQL and RabbitMQ.
//!
//! `orders-producer` writes each order **and** its event to the outbox in one transaction,
//! then relays unpublished outbox rows to a RabbitMQ queue. The relay is at least once: it
//! publishes, then marks the row published, so a crash between the two publishes the row
//! again (the producer's `--duplicate-every` simulates exactly that). `payments-consumer`
//! consumes with manual acks and books each payment through an idempotent function in
//! transactional mode: the booking row and the processed-message record commit together, so a
//! redelivery (a duplicate publish, a nack, a consumer killed mid-message) books nothing
//! twice and loses nothing.
//!
//! RabbitMQ rather than NATS JetStream: a consumer that dies hands its unacknowledged
//! messages back at once (its connection closes), where JetStream waits out the ack timeout,
//! and `basic.nack` with requeue makes a redelivery on demand; both make the redeliveries
//! this example shows happen quickly and for certain.

use serde::{Deserialize, Serialize};

/// The event an order emits: pay `amount` for `order`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentEvent {
    /// The event's id: the idempotency key of its processing.
    pub id: String,
    /// The tenant the order belongs to: the scope.
    pub tenant: String,
    /// The order.
    pub order: String,
    /// Amount, smallest currency unit.
    pub amount: i64,
}

/// What booking a payment produced (stored, and returned again on redelivery).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Booking {
    /// The booking row's id.
    pub booking: i64,
    /// The event booked.
    pub event: String,
}

/// Creates the tables both programs use, in schema `outbox_example` (idempotent; serialised
/// by an advisory lock).
///
/// # Errors
/// Database errors.
pub async fn create_tables(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(
        "SELECT pg_advisory_xact_lock(7201013);
         CREATE SCHEMA IF NOT EXISTS outbox_example;
         CREATE TABLE IF NOT EXISTS outbox_example.orders (
            id text PRIMARY KEY, tenant text NOT NULL, amount bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS outbox_example.outbox (
            seq bigserial PRIMARY KEY, destination text NOT NULL, event_id text NOT NULL,
            payload text NOT NULL, published_at timestamptz);
         CREATE INDEX IF NOT EXISTS outbox_unpublished ON outbox_example.outbox (destination, seq)
            WHERE published_at IS NULL;
         -- No unique constraint on event_id: a second booking of one event would be a bug
         -- this table shows rather than hides.
         CREATE TABLE IF NOT EXISTS outbox_example.bookings (
            id bigserial PRIMARY KEY, event_id text NOT NULL, tenant text NOT NULL,
            amount bigint NOT NULL);
         CREATE INDEX IF NOT EXISTS bookings_tenant ON outbox_example.bookings (tenant);",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// A pool on `url` that does not ping before each use.
///
/// # Errors
/// When the database is unreachable.
pub async fn pool(url: &str, max: u32) -> Result<sqlx::PgPool, sqlx::Error> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(false)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect(url)
        .await
}

/// The pool on `--database` (else `$DATABASE_URL`), with the tables created.
///
/// # Errors
/// A message naming what is missing or failed.
pub async fn connect(database: Option<&str>, max: u32) -> Result<sqlx::PgPool, String> {
    let url = database
        .map(str::to_owned)
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .ok_or("set --database or DATABASE_URL (PostgreSQL)")?;
    let pool = pool(&url, max).await.map_err(|e| e.to_string())?;
    create_tables(&pool).await.map_err(|e| e.to_string())?;
    Ok(pool)
}

/// A channel on RabbitMQ at `amqp` with the durable queue `queue` declared (both programs
/// declare it, so either may start first). Keep the connection for as long as the channel.
///
/// # Errors
/// A message naming what failed.
pub async fn channel(
    amqp: &str,
    queue: &str,
) -> Result<(lapin::Connection, lapin::Channel), String> {
    let conn = lapin::Connection::connect(amqp, lapin::ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot reach RabbitMQ at {amqp}: {e}"))?;
    let channel = conn.create_channel().await.map_err(|e| e.to_string())?;
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..lapin::options::QueueDeclareOptions::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok((conn, channel))
}
