//! Idempotent functions: any async function whose output is serializable, run at most once per
//! (scope, key), with its output stored and returned again on every redelivery. This is what
//! a queue consumer needs (most brokers deliver at least once: deduplicate by message id) and
//! what `#[idempotent(key_from = …)]` expands to.
//!
//! ```
//! use idempotent_core::call::{Call, CallError, Calls};
//! use idempotent_core::{Engine, IdempotencyKey, MemoryStore, Scope};
//!
//! #[derive(serde::Serialize)]
//! struct PaymentEvent { id: String, tenant: String, amount: i64 }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let calls = Calls::new(Engine::new(MemoryStore::new()));
//! let msg = PaymentEvent { id: "evt_1".into(), tenant: "t1".into(), amount: 500 };
//! let mut booked = 0;
//! for _delivery in 0..3 {
//!     // The message id is the key, the tenant the scope, the message the fingerprint.
//!     let call = Call::new("book_payment", Scope::new(&msg.tenant)?, IdempotencyKey::parse(msg.id.as_bytes())?, &msg)?;
//!     let receipt: Result<String, CallError<std::io::Error>> = calls
//!         .run(call, || async {
//!             booked += 1;
//!             Ok(format!("booked {}", msg.amount))
//!         })
//!         .await;
//!     assert_eq!(receipt?, "booked 500"); // the stored output, on every delivery
//! }
//! assert_eq!(booked, 1);
//! # Ok(()) }
//! ```
//!
//! # What is fingerprinted, stored and returned
//! - **Fingerprint**: SHA-256 over the function's name and the JSON of the arguments given to
//!   [`Call::new`] (canonicalised, RFC 8785: field order does not matter). The same key with
//!   other arguments, or for another function, is [`CallError::Mismatch`], never a replay.
//! - **Record**: the engine's stored-response record, so every store (memory, SQLite,
//!   PostgreSQL) holds it with no new table or migration: `Ok(output)` is status 200 with the
//!   output's JSON as the body; a stored error is status 422 with the error's JSON.
//! - **Errors release the key** (the next delivery runs the function again), unless the error
//!   type opts into being stored ([`StoredError`]) and the call goes through
//!   [`Calls::run_storing`]: then an error whose [`StoredError::is_stored`] is true is stored
//!   and returned again on every redelivery, like an output.
//! - A panic releases the key and resumes.
//! - An output that cannot be serialized is recorded as "not stored" (the work is done, so it
//!   must not run again): later deliveries get [`CallError::NotStored`].
//!
//! # Concurrent duplicates
//! Two deliveries of one message at once (two consumers, a redelivery while the first still
//! runs): the second gets [`CallError::InProgress`] at once ([`Concurrent::Refuse`], the
//! default: nack and let the broker redeliver later), or waits, bounded, for the first to
//! finish and returns its output ([`Concurrent::Wait`]; it polls the store).

use crate::{
    Begin, ConfigError, DEFAULT_LEASE, DEFAULT_TTL, DeriveSecret, Engine, Fingerprint,
    FingerprintInput, IdempotencyKey, Idempotent, Policy, Scope, StoreError, StoredOutcome,
    StoredResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::time::Duration;

/// Status of a stored output.
const OUTPUT: u16 = 200;
/// Status of a stored error.
const STORED_ERROR: u16 = 422;
/// The "method" in a call's fingerprint: no HTTP request has it.
const METHOD: &str = "CALL";

/// How a call meets a concurrent duplicate that is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Concurrent {
    /// [`CallError::InProgress`] at once.
    #[default]
    Refuse,
    /// Wait up to this long for the first to finish, polling the store, then return its
    /// output (or run, if it released the key); [`CallError::InProgress`] after that.
    Wait(Duration),
}

/// One call: which function, for whom, under which key, with which arguments.
#[derive(Debug, Clone)]
pub struct Call {
    name: &'static str,
    scope: Scope,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
}

impl Call {
    /// A call of the function `name` by `scope` under `key`; `args` (any `Serialize` value:
    /// the message, or a tuple of the arguments that identify the work) is fingerprinted.
    ///
    /// # Errors
    /// When `args` cannot be serialized (a map with non-string keys, a failing `Serialize`).
    pub fn new<A: Serialize + ?Sized>(
        name: &'static str,
        scope: Scope,
        key: IdempotencyKey,
        args: &A,
    ) -> Result<Self, serde_json::Error> {
        let json = serde_json::to_vec(args)?;
        let fingerprint = Fingerprint::compute(&FingerprintInput {
            method: METHOD,
            path: name,
            query: None,
            content_type: Some("application/json"),
            body: &json,
        });
        Ok(Call {
            name,
            scope,
            key,
            fingerprint,
        })
    }

    /// The function's name.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

/// An error type that opts into being stored by [`Calls::run_storing`]: an error for which
/// [`is_stored`](StoredError::is_stored) is true is recorded (as JSON) and returned on every
/// redelivery, without running the function again. Use it for final failures (a payment
/// declined, a message that can never be valid); keep `false` for the ones a retry can fix.
pub trait StoredError: Serialize + DeserializeOwned {
    /// Whether this error is final (stored) rather than retryable (the key is released).
    fn is_stored(&self) -> bool {
        true
    }
}

/// Why a call returned no output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallError<E> {
    /// The function returned this error (a stored one on a redelivery, too).
    #[error("the function failed")]
    Failed(E),
    /// Another delivery of this (scope, key) is running; try again after `retry_after`.
    #[error("another call with this key is running; retry after {retry_after:?}")]
    InProgress {
        /// Time until the other call's lease runs out.
        retry_after: Duration,
    },
    /// The key was used for another function or other arguments.
    #[error("the key was used for another call (another function or other arguments)")]
    Mismatch,
    /// The store failed; the function did not run.
    #[error("the idempotency store failed: {0}")]
    Store(StoreError),
    /// The engine is draining (shutting down); the function did not run.
    #[error("the engine is shutting down")]
    Draining,
    /// The ttl or lease is out of bounds, or the function takes an [`Idempotent`] context
    /// and no derive secret is configured; the function did not run.
    #[error("misconfigured: {0}")]
    Misconfigured(String),
    /// A stored output (or error) does not decode as this function's type (the type changed
    /// since it was stored); the function did not run.
    #[error("the stored output does not decode: {0}")]
    Decode(serde_json::Error),
    /// The function ran, but its output could not be stored (it did not serialize); it will
    /// not run again for this key until the record expires.
    #[error("the function ran but its output was not stored")]
    NotStored,
}

impl<E> From<ConfigError> for CallError<E> {
    fn from(e: ConfigError) -> Self {
        CallError::Misconfigured(e.to_string())
    }
}

/// Runs functions at most once per (scope, key): an [`Engine`] (and so a store) with the
/// settings of the functions that set none.
#[derive(Debug, Clone)]
pub struct Calls {
    engine: Engine,
    ttl: Duration,
    lease: Duration,
    concurrent: Concurrent,
    secret: Option<DeriveSecret>,
}

impl Calls {
    /// Calls over `engine`: ttl 24 h, lease 30 s, [`Concurrent::Refuse`], no derive secret.
    pub fn new(engine: Engine) -> Self {
        Calls {
            engine,
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            concurrent: Concurrent::Refuse,
            secret: None,
        }
    }

    /// How long an output is returned again (a floor); checked on each call.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long a crashed call blocks its key (heartbeat-extended while it runs).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How a call meets a concurrent duplicate (default [`Concurrent::Refuse`]).
    #[must_use]
    pub fn concurrent(mut self, concurrent: Concurrent) -> Self {
        self.concurrent = concurrent;
        self
    }

    /// The secret for [`Calls::run_with`]'s [`Idempotent::derive`] (see [`DeriveSecret`]).
    #[must_use]
    pub fn derive_secret(mut self, secret: DeriveSecret) -> Self {
        self.secret = Some(secret);
        self
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    fn policy(&self, name: &'static str) -> Policy {
        Policy {
            ttl: self.ttl,
            lease: self.lease,
            route: name,
            ..Policy::default()
        }
    }

    /// Runs `f` unless this call already ran: its stored output then comes back without
    /// running `f`. An `Err` releases the key.
    ///
    /// # Errors
    /// [`CallError`].
    pub async fn run<T, E, F, Fut>(&self, call: Call, f: F) -> Result<T, CallError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.go(call, f, |_: &E| None, |_| None).await
    }

    /// [`Calls::run`] for a function that takes the call's [`Idempotent`] context (to derive
    /// keys for the calls it makes downstream). Needs [`Calls::derive_secret`].
    ///
    /// # Errors
    /// [`CallError`]; [`CallError::Misconfigured`] without a derive secret.
    pub async fn run_with<T, E, F, Fut>(&self, call: Call, f: F) -> Result<T, CallError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(Idempotent) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let ctx = self.context(&call)?;
        self.go(call, move || f(ctx), |_: &E| None, |_| None).await
    }

    /// [`Calls::run`] for an error type that opts into being stored: an error whose
    /// [`StoredError::is_stored`] is true is stored and returned on every redelivery.
    ///
    /// # Errors
    /// [`CallError`].
    pub async fn run_storing<T, E, F, Fut>(&self, call: Call, f: F) -> Result<T, CallError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: StoredError,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.go(call, f, encode_stored::<E>, decode_stored::<E>)
            .await
    }

    /// [`Calls::run_storing`] with the [`Idempotent`] context ([`Calls::run_with`]).
    ///
    /// # Errors
    /// [`CallError`]; [`CallError::Misconfigured`] without a derive secret.
    pub async fn run_storing_with<T, E, F, Fut>(&self, call: Call, f: F) -> Result<T, CallError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: StoredError,
        F: FnOnce(Idempotent) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let ctx = self.context(&call)?;
        self.go(call, move || f(ctx), encode_stored::<E>, decode_stored::<E>)
            .await
    }

    fn context<E>(&self, call: &Call) -> Result<Idempotent, CallError<E>> {
        match &self.secret {
            Some(secret) => Ok(Idempotent::keyed(secret, &call.scope, &call.key)),
            None => Err(CallError::Misconfigured(format!(
                "`{}` takes an `Idempotent` context but no derive secret is configured",
                call.name
            ))),
        }
    }

    /// Claim → run → store, or replay; waits on a running duplicate per [`Concurrent`].
    async fn go<T, E, F, Fut>(
        &self,
        call: Call,
        f: F,
        encode_error: fn(&E) -> Option<Vec<u8>>,
        decode_error: fn(&[u8]) -> Option<Result<E, serde_json::Error>>,
    ) -> Result<T, CallError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let policy = self.policy(call.name);
        policy.check()?;
        let waited_from = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(10);
        let mut f = Some(f);
        loop {
            let request = crate::ExecuteRequest {
                scope: call.scope.clone(),
                key: Ok(call.key.clone()),
                fingerprint: call.fingerprint,
            };
            match self.engine.begin(request, &policy).await {
                Begin::Claimed(mut execution) => {
                    let Some(f) = f.take() else {
                        // Unreachable: the loop returns after the one claim it runs.
                        execution.release().await;
                        return Err(CallError::Misconfigured("claimed twice".into()));
                    };
                    let result = match execution.run(f()).await {
                        Ok(result) => result,
                        Err(panic) => {
                            execution.release().await;
                            std::panic::resume_unwind(panic)
                        }
                    };
                    let record = match &result {
                        Ok(output) => match serde_json::to_vec(output) {
                            Ok(json) => stored(OUTPUT, json),
                            // Done, but not storable: a marker, so it never runs twice.
                            Err(_) => StoredOutcome::Oversized {
                                status: OUTPUT,
                                size: 0,
                            },
                        },
                        Err(error) => match encode_error(error) {
                            Some(json) => stored(STORED_ERROR, json),
                            None => {
                                execution.release().await;
                                return result.map_err(CallError::Failed);
                            }
                        },
                    };
                    let not_stored = matches!(record, StoredOutcome::Oversized { .. });
                    // A failed store is logged by the engine; the record stays in progress
                    // until its lease ends, so a redelivery meanwhile waits, not re-runs.
                    execution.finish(record).await;
                    return match result {
                        Ok(_) if not_stored => Err(CallError::NotStored),
                        other => other.map_err(CallError::Failed),
                    };
                }
                Begin::Replay(outcome) => return replay(outcome, decode_error),
                Begin::InProgress { retry_after } => {
                    let Concurrent::Wait(limit) = self.concurrent else {
                        return Err(CallError::InProgress { retry_after });
                    };
                    let left = limit.saturating_sub(waited_from.elapsed());
                    if left.is_zero() {
                        return Err(CallError::InProgress { retry_after });
                    }
                    tokio::time::sleep(pause.min(left).min(retry_after.max(pause))).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                Begin::Mismatch { .. } => return Err(CallError::Mismatch),
                Begin::KeyRejected(e) => return Err(CallError::Misconfigured(e.to_string())),
                Begin::StoreUnavailable(e) => return Err(CallError::Store(e)),
                Begin::Draining => return Err(CallError::Draining),
                Begin::Misconfigured(e) => return Err(e.into()),
                // Keys are always given and fail-open is off: neither can happen.
                Begin::Unprotected(_) => {
                    return Err(CallError::Misconfigured("ran unprotected".into()));
                }
            }
        }
    }
}

fn stored(status: u16, body: Vec<u8>) -> StoredOutcome {
    StoredResponse::new(status, body)
        .with_header("content-type", "application/json")
        .into()
}

fn encode_stored<E: StoredError>(error: &E) -> Option<Vec<u8>> {
    if error.is_stored() {
        serde_json::to_vec(error).ok()
    } else {
        None
    }
}

fn decode_stored<E: StoredError>(json: &[u8]) -> Option<Result<E, serde_json::Error>> {
    Some(serde_json::from_slice(json))
}

fn replay<T: DeserializeOwned, E>(
    outcome: StoredOutcome,
    decode_error: fn(&[u8]) -> Option<Result<E, serde_json::Error>>,
) -> Result<T, CallError<E>> {
    match outcome {
        StoredOutcome::Response(r) if r.status == OUTPUT => {
            serde_json::from_slice(&r.body).map_err(CallError::Decode)
        }
        StoredOutcome::Response(r) if r.status == STORED_ERROR => match decode_error(&r.body) {
            Some(Ok(error)) => Err(CallError::Failed(error)),
            Some(Err(e)) => Err(CallError::Decode(e)),
            None => Err(CallError::Decode(serde::de::Error::custom(
                "a stored error, for a call whose errors are not stored",
            ))),
        },
        StoredOutcome::Response(r) => Err(CallError::Decode(serde::de::Error::custom(format!(
            "a record with status {}, not a call's",
            r.status
        )))),
        StoredOutcome::Oversized { .. } => Err(CallError::NotStored),
    }
}
