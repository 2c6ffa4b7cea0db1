//! Everything about HTTP that is not a framework type, on plain types (`&str`, `&[u8]`, `u16`),
//! so the Axum and Actix adapters share one implementation and differ only in glue.
//!
//! What a user names is here: the header names ([`IDEMPOTENCY_KEY`], [`IDEMPOTENT_REPLAYED`],
//! [`PROBLEM_JSON`]), the application's settings ([`Config`], built and validated once by
//! [`ConfigBuilder`]) and their defaults and bounds. The request driver the adapters share
//! lives in this module's private files (see `ARCHITECTURE.md`):
//!
//! - `request.rs`: which requests are protected, the checks that run before a body is read,
//!   which response headers are stored, the request's fingerprint;
//! - `route.rs`: each route's arguments resolved against the [`Config`];
//! - `capture.rs`: a copy of the handler's response bounded by the route's limit, and the
//!   rules for a streamed body;
//! - `reply.rs`: one exhaustive map from the engine's answer to what the adapter does, and
//!   the library's own replies (replays and RFC 9457 problems);
//! - `decode.rs`: bounded `Content-Encoding` decoding for the fingerprint;
//! - `driver.rs`: one request's whole life, generic over an adapter's glue.

pub(crate) mod capture;
mod config;
#[cfg(any(
    feature = "compress-gzip",
    feature = "compress-brotli",
    feature = "compress-zstd"
))]
mod decode;
pub(crate) mod driver;
pub(crate) mod reply;
pub(crate) mod request;
pub(crate) mod route;

pub use crate::engine::{ConfigError, MAX_DURATION, MIN_DURATION};
pub use crate::key::MAX_KEY_LEN;
pub use crate::problem::PROBLEM_BASE;
pub use config::{Config, ConfigBuilder};
pub use request::FINGERPRINT_INLINE_MAX;
pub(crate) use request::{
    RequestHead, check_content_length, check_key, connection_options, is_safe_method,
    is_stored_header,
};
use std::time::Duration;

/// The request header carrying the key (lower case, as HTTP/2 and the `http` crates spell it).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header saying whether a response is a replay (`true`) or a first execution
/// (`false`).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// The media type of the library's error responses (RFC 9457).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Default limit on stored responses: 1 MiB.
pub const DEFAULT_MAX_RESPONSE: usize = crate::engine::DEFAULT_MAX_STORED;
/// Default limit on request bodies read for fingerprinting: 2 MiB.
pub const DEFAULT_MAX_REQUEST: usize = 2 << 20;
/// Default time allowed to read a request body for fingerprinting: 30 s.
pub const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);
