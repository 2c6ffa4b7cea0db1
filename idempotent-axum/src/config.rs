//! The configuration an application installs once: [`Idempotency`].

idempotent_core::__idempotency_type!(
    idempotent_axum,
    install = "`.layer(idempotency.layer())`",
    drain = "Call it after the server stopped accepting connections (after \
             `axum::serve(..).with_graceful_shutdown(..)` returned): a handler whose client \
             went away keeps running after its connection closed, and this lets it store its \
             response before the process exits."
);
