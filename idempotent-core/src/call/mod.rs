//! Idempotent functions: any async function whose output is serializable, run once per
//! (scope, key) until it succeeds, with its output stored and returned again on every
//! redelivery. This is what
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
//!     let call = Call::new("book_payment", Scope::new(&msg.tenant)?, IdempotencyKey::opaque(msg.id.as_str())?, &msg)?;
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
//! # The name is the identity
//! A function's records belong to its **name** (the attribute's required `name = "…"`, the
//! first argument of [`Call::new`]), never to where its code lives: the record's scope is
//! the caller's scope within that name (`call:<len>:<name>:<scope>`), the name is part of
//! the fingerprint, and derived downstream keys come from that scope. So:
//! - moving the function to another module, renaming the Rust function or splitting a crate
//!   between a delivery and its redelivery keeps its records: the redelivery replays, and a
//!   re-run derives the same downstream keys;
//! - changing the name is a new function: a redelivery of a message the old name already
//!   handled runs again and derives new downstream keys (a double charge downstream, unless
//!   the provider deduplicates otherwise). Rename only when no message of the old name can
//!   still arrive (after the ttl), or keep the old name;
//! - two functions must not share a name unless they are the same operation (one runs,
//!   the other replays its output, or gets [`CallError::Mismatch`] for other arguments).
//!
//! A name is 1 to 64 ([`Call::MAX_NAME_LEN`]) ASCII letters, digits, `_`, `-` or `.`
//! (`book_payment`, `billing.book-payment.v2`); the attribute refuses another at compile
//! time, [`Call::new`] with [`InvalidCall::Name`]. It is also the `route` of the function's
//! logs and metrics.
//!
//! # What is fingerprinted, stored and returned
//! - **Fingerprint**: SHA-256 over the function's name and the JSON of the arguments given to
//!   [`Call::new`] (canonicalised, RFC 8785: field order does not matter). The attribute
//!   gives it every input of the function: each parameter's JSON (one input alone, several
//!   as an array in parameter order), except the runner, the transaction, the `Idempotent`
//!   context, the scope's parameter and those marked `#[idempotent(skip)]`; an input that is
//!   not `Serialize` is a compile error. The same key with other arguments, or for another
//!   function, is [`CallError::Mismatch`], never a replay.
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
//! # Limits
//! - `run` is not detached: if its future is dropped while the function runs (a timeout, a
//!   `select!`, shutdown), the record stays in progress until its lease ends, and a
//!   redelivery after that runs the function again. Run calls whose caller may be cancelled
//!   in a task of their own (`tokio::spawn`).
//! - Plain mode (`run`): if storing the output fails even after bounded retries (logged), the
//!   output is still returned and the record stays in progress until its lease ends; a
//!   redelivery after that runs the function again. Transactional mode (`run_tx`) has no such
//!   gap: the output commits with the function's writes or neither does.
//! - JSON numbers are doubles in the fingerprint (RFC 8785): arguments that differ only in an
//!   integer above 2^53 fingerprint the same.
//!
//! # Concurrent duplicates
//! Two deliveries of one message at once (two consumers, a redelivery while the first still
//! runs): the second gets [`CallError::InProgress`] at once ([`Concurrent::Refuse`], the
//! default: nack and let the broker redeliver later), or waits, bounded, for the first to
//! finish and returns its output ([`Concurrent::Wait`]: woken by the store's change
//! notifications, as an HTTP route's `wait` is, see [`Policy::wait`]; a transactional call
//! polls the store). The wait is at most the lease: a longer one is refused
//! ([`CallError::Misconfigured`]).

use crate::derive::Idempotent;
use crate::engine::{Begin, ConfigError, Engine, ExecuteRequest, Policy};
use crate::fingerprint::{Fingerprint, FingerprintInput};
use crate::key::{IdempotencyKey, KeyError};
use crate::scope::{Scope, ScopeError};
use crate::store::StoreError;
use crate::store::record::{StoredOutcome, StoredResponse};
use crate::tx::CommitPath;
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
    /// Wait up to this long (at most the lease) for the first to finish, then return its
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
    ttl: Option<Duration>,
    lease: Option<Duration>,
    concurrent: Option<Concurrent>,
}

impl Call {
    /// A call of the function `name` by `scope` under `key`; `args` (any `Serialize` value:
    /// the message, or a tuple of the arguments that identify the work) is fingerprinted.
    /// Make a message id's key with [`IdempotencyKey::opaque`] (the id as it is), not
    /// [`IdempotencyKey::parse`], which reads a header's value (trims it, unquotes an
    /// sf-string) and refuses text a header cannot carry.
    ///
    /// **`name` is the identity of the function's records**: the record's scope is `scope`
    /// within `name`, and the name is part of the fingerprint and of every derived key. So
    /// two functions consuming one message each run once and derive keys of their own, and
    /// one function keeps its records wherever its code lives. Give each function a distinct
    /// name that you never change (the attribute's `name = "…"`): a redelivery under another
    /// name runs the function again and derives new downstream keys. See the
    /// [module docs](self#the-name-is-the-identity).
    ///
    /// A name is 1 to [`Call::MAX_NAME_LEN`] ASCII letters, digits, `_`, `-` or `.`.
    ///
    /// # Errors
    /// [`InvalidCall`]: the name breaks that rule ([`InvalidCall::Name`]), `args` cannot be
    /// serialized (a map with non-string keys, a failing `Serialize`), or the scope with the
    /// name is longer than a scope may be.
    pub fn new<A: Serialize + ?Sized>(
        name: &'static str,
        scope: Scope,
        key: IdempotencyKey,
        args: &A,
    ) -> Result<Self, InvalidCall> {
        let json = serde_json::to_vec(args).map_err(InvalidCall::Encode)?;
        Self::from_json(name, scope, key, &json)
    }

    /// [`Call::new`] with the arguments' JSON already written.
    fn from_json(
        name: &'static str,
        scope: Scope,
        key: IdempotencyKey,
        json: &[u8],
    ) -> Result<Self, InvalidCall> {
        check_name(name).map_err(InvalidCall::Name)?;
        let scope = Scope::function(name, &scope).map_err(InvalidCall::Scope)?;
        let fingerprint = Fingerprint::compute(&FingerprintInput {
            method: METHOD,
            path: name,
            query: None,
            content_type: Some("application/json"),
            body: json,
        });
        Ok(Call {
            name,
            scope,
            key,
            fingerprint,
            ttl: None,
            lease: None,
            concurrent: None,
        })
    }

    /// This call's ttl, instead of the [`Calls`]' default.
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// This call's lease, instead of its engine's ([`Engine::lease`]).
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// How this call meets a running duplicate, instead of the [`Calls`]' default.
    #[must_use]
    pub fn with_concurrent(mut self, concurrent: Concurrent) -> Self {
        self.concurrent = Some(concurrent);
        self
    }

    /// The function's name: the identity of its records.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The scope the records of function `name` for `caller` are kept under
    /// (`call:<len>:<name>:<caller>`), for tools that look a function's record up in a store
    /// ([`Store::get`](crate::Store::get), an admin tool). No caller identity can be this
    /// scope: [`Scope::new`] refuses the `call:` prefix.
    ///
    /// ```
    /// use idempotent_core::{call::Call, Scope};
    /// let scope = Call::record_scope("book", &Scope::new("acme")?)?;
    /// assert_eq!(scope.as_str(), "call:4:book:acme");
    /// assert!(Scope::new("call:4:book:acme").is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`InvalidCall::Name`] when `name` breaks the rule of names (see [`Call::new`]),
    /// [`InvalidCall::Scope`] when the scope with the name is too long.
    pub fn record_scope(name: &str, caller: &Scope) -> Result<Scope, InvalidCall> {
        check_name(name).map_err(InvalidCall::Name)?;
        Scope::function(name, caller).map_err(InvalidCall::Scope)
    }

    /// The longest name a function may have, in bytes.
    pub const MAX_NAME_LEN: usize = 64;
}

/// The rule of a function's name (the attribute's `name = "…"` checks the same at compile
/// time): 1 to [`Call::MAX_NAME_LEN`] ASCII letters, digits, `_`, `-` or `.`, so it reads the
/// same in every store, log line and metric label, and no `:` blurs it with the scope.
fn check_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(NameError::Char(c));
    }
    if name.len() > Call::MAX_NAME_LEN {
        return Err(NameError::TooLong { len: name.len() });
    }
    Ok(())
}

/// Why a function's name was refused ([`Call::new`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// The name is empty.
    #[error("the function name is empty")]
    Empty,
    /// The name is longer than [`Call::MAX_NAME_LEN`] bytes.
    #[error(
        "the function name is {len} bytes long; the limit is {}",
        Call::MAX_NAME_LEN
    )]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The name holds a character other than an ASCII letter, digit, `_`, `-` or `.`.
    #[error("the function name holds {0:?}; use ASCII letters, digits, `_`, `-` or `.`")]
    Char(char),
}

/// Why a [`Call`] could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidCall {
    /// The function's name breaks the rule of names (see [`Call::new`]).
    #[error("invalid function name: {0}")]
    Name(NameError),
    /// The arguments could not be serialized.
    #[error("the arguments cannot be serialized: {0}")]
    Encode(serde_json::Error),
    /// The scope, within the function's name, is not a valid scope (too long).
    #[error("invalid scope: {0}")]
    Scope(ScopeError),
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
    #[error("the function failed: {0}")]
    Failed(E),
    /// Another delivery of this (scope, key) is running; try again after `retry_after`.
    #[error("another call with this key is running; retry after {retry_after:?}")]
    InProgress {
        /// A hint: time until the other call's lease runs out (on the single-commit path,
        /// a short fixed time).
        retry_after: Duration,
    },
    /// The key was used for another function or other arguments.
    #[error("the key was used for another call (another function or other arguments)")]
    Mismatch,
    /// The store failed: before the function ran (it did not), or, in transactional mode,
    /// at the commit after it ran, when its writes may or may not have committed (a
    /// redelivery then replays if they did and runs if they did not).
    #[error("the idempotency store failed: {0}")]
    Store(StoreError),
    /// The engine is draining (shutting down); the function did not run.
    #[error("the engine is shutting down")]
    Draining,
    /// The ttl or lease is out of bounds, the function's name is invalid, the function
    /// takes an [`Idempotent`] context and no derive secret is configured, or the store is
    /// not on a transactional call's database: the function did not run. Also when a transactional function kept its transaction
    /// past its return: it ran, and its writes rolled back.
    #[error("misconfigured: {0}")]
    Misconfigured(String),
    /// A stored output (or error) does not decode as this function's type (the type changed
    /// since it was stored); the function did not run.
    #[error("the stored output does not decode: {0}")]
    Decode(serde_json::Error),
    /// The key given to the call is not a valid key (empty, longer than 255 bytes, holding
    /// NUL: see [`IdempotencyKey::opaque`]); nothing ran.
    #[error("invalid key: {0}")]
    InvalidKey(KeyError),
    /// The scope given to the call is not a valid scope; nothing ran.
    #[error("invalid scope: {0}")]
    InvalidScope(ScopeError),
    /// The arguments could not be serialized for the fingerprint; nothing ran.
    #[error("the arguments cannot be serialized: {0}")]
    Encode(serde_json::Error),
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
    concurrent: Concurrent,
    commit: Option<CommitPath>,
}

impl Calls {
    /// Calls over `engine` (whose lease, derive secret and sweeper they use,
    /// [`Engine::builder`]): ttl 24 h (or the engine's lease, if that is longer),
    /// [`Concurrent::Refuse`]. The engine's first call starts its sweeper (every 60 s by
    /// default; [`EngineBuilder::no_sweeper`](crate::engine::EngineBuilder::no_sweeper) for
    /// none), as its first HTTP request would.
    pub fn new(engine: Engine) -> Self {
        Calls {
            ttl: engine.default_ttl(),
            engine,
            concurrent: Concurrent::Refuse,
            commit: None,
        }
    }

    /// How long an output is returned again (a floor); checked on each call.
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How a call meets a concurrent duplicate (default [`Concurrent::Refuse`]).
    #[must_use]
    pub fn concurrent(mut self, concurrent: Concurrent) -> Self {
        self.concurrent = concurrent;
        self
    }

    /// The commit path of [`Calls::run_tx`] (default: each database's, [`crate::tx`]).
    #[must_use]
    pub fn commit_path(mut self, commit: CommitPath) -> Self {
        self.commit = Some(commit);
        self
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    fn policy(&self, call: &Call) -> Policy {
        Policy {
            ttl: call.ttl.unwrap_or(self.ttl),
            lease: call.lease.unwrap_or(self.engine.lease()),
            route: call.name,
            // A function's output has no limit to reserve (an HTTP route's `max_response`):
            // stores with byte budgets charge it when it is stored, so a consumer's messages in
            // flight are not bounded by a reservation each.
            max_stored: 0,
            // Plain calls wait in the engine, woken by the store's notifications
            // (transactional calls poll, `go_tx`).
            wait: match call.concurrent.unwrap_or(self.concurrent) {
                Concurrent::Wait(wait) => wait,
                Concurrent::Refuse => Duration::ZERO,
            },
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

    /// The call's [`Idempotent`] context, for a function that derives keys for the calls it
    /// makes downstream: move it into the closure you give [`Calls::run`]. Needs the engine's
    /// derive secret ([`EngineBuilder::derive_secret`](crate::engine::EngineBuilder::derive_secret)).
    ///
    /// # Errors
    /// [`CallError::Misconfigured`] without a derive secret.
    pub fn context<E>(&self, call: &Call) -> Result<Idempotent, CallError<E>> {
        match self.engine.derive_secret() {
            Some(secret) => Ok(Idempotent::keyed(secret, &call.scope, &call.key)),
            None => Err(CallError::Misconfigured(format!(
                "`{}` takes an `Idempotent` context but its engine has no derive secret",
                call.name
            ))),
        }
    }

    fn request(call: &Call) -> ExecuteRequest {
        ExecuteRequest {
            scope: call.scope.clone(),
            key: Ok(call.key.clone()),
            fingerprint: call.fingerprint,
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
        let policy = self.policy(&call);
        policy.check()?;
        // The engine waited already, per the policy's wait: what it answers is final.
        let mut waiting = Waiting::new(Concurrent::Refuse);
        loop {
            let mut execution = match self.engine.begin(Self::request(&call), &policy).await {
                Begin::Claimed(execution) => execution,
                other => match settle(other, &mut waiting, decode_error).await {
                    Settled::Done(result) => return result,
                    Settled::Again => continue,
                },
            };
            // The closure is called inside `run`, so a panic before its future exists is
            // caught too.
            let result = match execution.run(async move { f().await }).await {
                Ok(result) => result,
                Err(panic) => {
                    execution.release().await;
                    std::panic::resume_unwind(panic)
                }
            };
            let Some(record) = record_of(&result, encode_error) else {
                execution.release().await;
                return result.map_err(CallError::Failed);
            };
            let not_stored = matches!(record, StoredOutcome::Oversized { .. });
            // A failed store (after bounded retries) is logged by the engine and the output
            // still returned, so the consumer acks: nacking would bring the message back to
            // run again once the lease ends. The record stays in progress until then; a
            // redelivery after it (a duplicate publish) runs the body again: plain mode's
            // documented limit, which transactional mode (`run_tx`) does not have.
            execution.finish(record).await;
            return match result {
                Ok(_) if not_stored => Err(CallError::NotStored),
                other => other.map_err(CallError::Failed),
            };
        }
    }
}

/// Transactional mode: the function writes through a [`Transaction`](crate::Transaction) on
/// the store's own database, and its record commits **with** those writes, in one commit (the
/// default path of each database, [`crate::tx`]), or not at all. A consumer that books a
/// payment row and acks: the row and the processed-message record commit together, so a
/// redelivery after a crash either finds both or neither.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod transactional {
    use super::*;
    use crate::tx::{
        DEFAULT_COMMIT, DEFAULT_MAX_WAITERS, DEFAULT_TX_WAIT, Halted, Transaction, TxBegin,
        TxDatabase, TxFinished, TxOptions,
    };

    impl Calls {
        /// [`Calls::run`] in transactional mode: `f` gets the transaction; an `Ok` commits its
        /// writes with the stored output, an `Err` (or a panic) rolls them back and releases
        /// the key. The engine's store must be on `DB` ([`CallError::Misconfigured`]
        /// otherwise).
        ///
        /// # Errors
        /// [`CallError`]; [`CallError::Store`] when the commit failed (nothing committed).
        pub async fn run_tx<DB, T, E, F, Fut>(&self, call: Call, f: F) -> Result<T, CallError<E>>
        where
            DB: TxDatabase,
            T: Serialize + DeserializeOwned,
            F: FnOnce(Transaction<DB>) -> Fut,
            Fut: Future<Output = Result<T, E>>,
        {
            self.go_tx(call, f, |_: &E| None, |_| None).await
        }

        /// [`Calls::run_tx`] for an error type that opts into being stored: a stored error
        /// commits the function's writes with it (its choice, as a 4xx does over HTTP).
        ///
        /// # Errors
        /// [`CallError`].
        pub async fn run_tx_storing<DB, T, E, F, Fut>(
            &self,
            call: Call,
            f: F,
        ) -> Result<T, CallError<E>>
        where
            DB: TxDatabase,
            T: Serialize + DeserializeOwned,
            E: StoredError,
            F: FnOnce(Transaction<DB>) -> Fut,
            Fut: Future<Output = Result<T, E>>,
        {
            self.go_tx(call, f, encode_stored::<E>, decode_stored::<E>)
                .await
        }

        async fn go_tx<DB, T, E, F, Fut>(
            &self,
            call: Call,
            f: F,
            encode_error: fn(&E) -> Option<Vec<u8>>,
            decode_error: fn(&[u8]) -> Option<Result<E, serde_json::Error>>,
        ) -> Result<T, CallError<E>>
        where
            DB: TxDatabase,
            T: Serialize + DeserializeOwned,
            F: FnOnce(Transaction<DB>) -> Fut,
            Fut: Future<Output = Result<T, E>>,
        {
            let policy = self.policy(&call);
            policy.check()?;
            // A transactional call polls for a running duplicate itself (`Waiting` below).
            let policy = Policy {
                wait: Duration::ZERO,
                ..policy
            };
            let options = TxOptions {
                commit: self.commit.unwrap_or(DEFAULT_COMMIT),
                wait: DEFAULT_TX_WAIT,
                max_waiters: DEFAULT_MAX_WAITERS,
                read_first: true,
            };
            let mut waiting = Waiting::new(call.concurrent.unwrap_or(self.concurrent));
            loop {
                let begin = self
                    .engine
                    .begin_transactional::<DB>(Self::request(&call), &policy, &options)
                    .await;
                let mut execution = match begin {
                    TxBegin::Run(execution) => execution,
                    TxBegin::Respond(other) => {
                        match settle(other, &mut waiting, decode_error).await {
                            Settled::Done(result) => return result,
                            Settled::Again => continue,
                        }
                    }
                    TxBegin::WrongStore { wanted } => {
                        return Err(CallError::Misconfigured(format!(
                            "`{}` writes through a {wanted} transaction, but the store is not on {wanted}",
                            call.name
                        )));
                    }
                };
                let Some(tx) = execution.transaction() else {
                    execution.abort().await;
                    return Err(CallError::Misconfigured("no transaction".into()));
                };
                let result = match execution.run(async move { f(tx).await }).await {
                    Ok(result) => result,
                    Err(Halted::Panicked(panic)) => {
                        execution.abort().await;
                        std::panic::resume_unwind(panic)
                    }
                    Err(Halted::OverLease(bound)) => {
                        execution.abort().await;
                        let stopped = crate::tx::commit::OverLease(bound);
                        return Err(CallError::Store(StoreError::unavailable(stopped)));
                    }
                };
                // An error that is not stored: a status the policy releases, so the writes
                // roll back and the key is released.
                let record = record_of(&result, encode_error)
                    .unwrap_or_else(|| StoredResponse::new(500, Vec::new()).into());
                let not_stored = matches!(record, StoredOutcome::Oversized { .. });
                return match execution.finish(record).await {
                    TxFinished::Committed | TxFinished::RolledBack => match result {
                        Ok(_) if not_stored => Err(CallError::NotStored),
                        other => other.map_err(CallError::Failed),
                    },
                    TxFinished::Failed(e) => Err(CallError::Store(e)),
                    TxFinished::Escaped => Err(CallError::Misconfigured(format!(
                        "`{}` kept its transaction past its return, so nothing was committed",
                        call.name
                    ))),
                };
            }
        }
    }
}

/// Bounded waiting for a running duplicate ([`Concurrent::Wait`]).
struct Waiting {
    concurrent: Concurrent,
    since: tokio::time::Instant,
    pause: Duration,
}

impl Waiting {
    fn new(concurrent: Concurrent) -> Self {
        Waiting {
            concurrent,
            since: tokio::time::Instant::now(),
            pause: Duration::from_millis(10),
        }
    }

    /// Sleeps before the next look, or says to give up.
    async fn again(&mut self, retry_after: Duration) -> bool {
        let Concurrent::Wait(limit) = self.concurrent else {
            return false;
        };
        let left = limit.saturating_sub(self.since.elapsed());
        if left.is_zero() {
            return false;
        }
        // `retry_after` is when the other's lease would run out; it usually finishes far
        // sooner, so poll with a growing pause instead.
        let _ = retry_after;
        tokio::time::sleep(self.pause.min(left)).await;
        self.pause = (self.pause * 2).min(Duration::from_millis(500));
        true
    }
}

enum Settled<T, E> {
    Done(Result<T, CallError<E>>),
    Again,
}

/// What a claim that did not run the function means for the caller.
async fn settle<T: DeserializeOwned, E>(
    begin: Begin,
    waiting: &mut Waiting,
    decode_error: fn(&[u8]) -> Option<Result<E, serde_json::Error>>,
) -> Settled<T, E> {
    Settled::Done(match begin {
        Begin::Replay(outcome) => replay(outcome, decode_error),
        Begin::InProgress { retry_after } => {
            if waiting.again(retry_after).await {
                return Settled::Again;
            }
            Err(CallError::InProgress { retry_after })
        }
        Begin::Mismatch { .. } => Err(CallError::Mismatch),
        Begin::KeyRejected(e) => Err(CallError::Misconfigured(e.to_string())),
        Begin::StoreUnavailable(e) => Err(CallError::Store(e)),
        Begin::Draining => Err(CallError::Draining),
        Begin::Misconfigured(e) => Err(e.into()),
        // A claim runs the function; keys are always given and fail-open is off, so nothing
        // runs unprotected.
        Begin::Claimed(_) | Begin::Unprotected(_) => Err(CallError::Misconfigured(
            "an unexpected claim outcome".into(),
        )),
    })
}

/// The record of a result: the output (or a "not stored" marker when it does not serialize),
/// a stored error, or `None` for an error that releases the key.
fn record_of<T: Serialize, E>(
    result: &Result<T, E>,
    encode_error: fn(&E) -> Option<Vec<u8>>,
) -> Option<StoredOutcome> {
    match result {
        Ok(output) => Some(match serde_json::to_vec(output) {
            Ok(json) => stored(OUTPUT, json),
            // Done, but not storable: a marker, so it never runs twice.
            Err(_) => StoredOutcome::Oversized {
                status: OUTPUT,
                size: 0,
            },
        }),
        Err(error) => encode_error(error).map(|json| stored(STORED_ERROR, json)),
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

/// A value that can be a call's idempotency key (a message id): text, integers, UUIDs.
///
/// The key is **opaque** ([`IdempotencyKey::opaque`]): the text as it is, byte for byte.
/// A message id is no `Idempotency-Key` header, so nothing is trimmed or unquoted: ids `m1`,
/// ` m1` and `"m1"` are three messages, each run once. Integers are their decimal text, UUIDs
/// their hyphenated lower-case text.
pub trait CallKey {
    /// The key.
    ///
    /// # Errors
    /// When it is not a valid key: empty, over 255 bytes, or holding NUL.
    fn to_key(&self) -> Result<IdempotencyKey, KeyError>;
}

impl CallKey for str {
    fn to_key(&self) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::opaque(self)
    }
}

impl CallKey for String {
    fn to_key(&self) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::opaque(self.as_str())
    }
}

impl<T: CallKey + ?Sized> CallKey for &T {
    fn to_key(&self) -> Result<IdempotencyKey, KeyError> {
        (**self).to_key()
    }
}

impl CallKey for uuid::Uuid {
    fn to_key(&self) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::opaque(self.hyphenated().to_string())
    }
}

macro_rules! integer_keys {
    ($($t:ty),*) => {$(
        impl CallKey for $t {
            fn to_key(&self) -> Result<IdempotencyKey, KeyError> {
                IdempotencyKey::opaque(self.to_string())
            }
        }
    )*};
}
integer_keys!(
    u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize
);

/// One function's attribute arguments, as `#[idempotent(key_from = …)]` writes them (a
/// `static` per function). Not a stable API.
#[doc(hidden)]
#[derive(Debug)]
pub struct Function {
    name: &'static str,
    ttl: Option<Duration>,
    lease: Option<Duration>,
    wait: Option<Duration>,
}

/// What `#[idempotent(key_from = …)]` wrote for a function, by name (`None`: the [`Calls`]'
/// default), so its three durations can never be swapped unnoticed. Not a stable API.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct FunctionArgs {
    /// The function's stable `name = "…"`.
    pub name: &'static str,
    /// `ttl = "…"`.
    pub ttl: Option<Duration>,
    /// `lease = "…"`.
    pub lease: Option<Duration>,
    /// `wait = "…"`.
    pub wait: Option<Duration>,
}

impl Function {
    /// The function with the arguments its attribute wrote.
    pub const fn new(args: FunctionArgs) -> Self {
        let FunctionArgs {
            name,
            ttl,
            lease,
            wait,
        } = args;
        Function {
            name,
            ttl,
            lease,
            wait,
        }
    }

    /// The call of this function by `scope` under `key` with its `inputs` fingerprinted: the
    /// JSON of the one input, or a JSON array of them in parameter order (`null` for none).
    /// One input is fingerprinted exactly as [`Call::new`] with that value would be.
    ///
    /// # Errors
    /// [`CallError::InvalidScope`], [`CallError::InvalidKey`], [`CallError::Encode`].
    pub fn call<K: CallKey + ?Sized, E>(
        &self,
        scope: Result<Scope, ScopeError>,
        key: &K,
        inputs: &[&dyn Input],
    ) -> Result<Call, CallError<E>> {
        let scope = scope.map_err(CallError::InvalidScope)?;
        let key = key.to_key().map_err(CallError::InvalidKey)?;
        let json = match inputs {
            [one] => one.json(),
            [] => Ok(b"null".to_vec()),
            many => many
                .iter()
                .map(|input| input.json())
                .collect::<Result<Vec<_>, _>>()
                .map(|parts| [&b"["[..], &parts.join(&b","[..]), b"]"].concat()),
        }
        .map_err(CallError::Encode)?;
        let mut call = Call::from_json(self.name, scope, key, &json).map_err(|e| match e {
            InvalidCall::Encode(e) => CallError::Encode(e),
            InvalidCall::Scope(e) => CallError::InvalidScope(e),
            // The attribute checks its `name` at compile time; kept for completeness.
            InvalidCall::Name(e) => CallError::Misconfigured(e.to_string()),
        })?;
        call.ttl = self.ttl;
        call.lease = self.lease;
        call.concurrent = self.wait.map(Concurrent::Wait);
        Ok(call)
    }
}

/// An input of an idempotent function: a parameter the attribute fingerprints (every one but
/// the runner, the transaction, the `Idempotent` context, the scope and those marked
/// `#[idempotent(skip)]`). Any `Serialize` value is one. Not a stable API: the expansion
/// names it.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not implement `serde::Serialize`, so it cannot be part of the idempotent function's fingerprint",
    label = "this parameter is fingerprinted",
    note = "an idempotent function fingerprints every parameter (the same key with other arguments is `CallError::Mismatch`) except its runner, its `Transaction`, its `Idempotent` context and its scope",
    note = "derive `Serialize` for it, or mark a parameter that is no input of the operation (a pool, a client, a counter) `#[idempotent(skip)]`"
)]
pub trait Input {
    /// The value's JSON.
    ///
    /// # Errors
    /// When it does not serialize (a map with non-string keys, a failing `Serialize`).
    fn json(&self) -> Result<Vec<u8>, serde_json::Error>;
}

impl<T: Serialize> Input for T {
    fn json(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }
}
