//! Runnable demos of `idempotent`.
//!
//! [`charges`] is the domain of the Stripe-shaped charges API (validation, the charge and
//! refund objects, the tables) and [`api`] what its routes do and answer, both without a web
//! framework; the binaries `charges-axum` and `charges-actix` hold only their framework's glue
//! around them, so they serve exactly the same contract.
//!
//! [`provider`] is the fake payment provider the charges handler pays through (it
//! deduplicates by the key derived from the request's), and [`proxy`] the lossy TCP proxy
//! that `charges-client` sends its charges through.
//!
//! [`outbox`] is the queue pair's shared part: `orders-producer` writes orders with their
//! events through a transactional outbox and relays them to RabbitMQ; `payments-consumer`
//! books each event once through an idempotent function, whatever the broker redelivers.
//!
//! The small examples (`axum-minimal`, `actix-minimal`, `tx-sqlite`, `consumer`) use none of
//! this library: each is one file in `src/bin/`, whole on its own.

pub mod api;
pub mod charges;
pub mod outbox;
pub mod provider;
pub mod proxy;
