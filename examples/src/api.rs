//! The charges API as both binaries serve it, without a web framework: the command line, the
//! caller's identity, request validation, what each route does and answers. Each binary
//! (`charges-axum`, `charges-actix`) holds only its framework's glue around this.

use crate::charges::{
    self, Charge, Charges, InvalidCharge, Kind, NewCharge, NewRefund, Refund, Writer,
};
use crate::provider::{Payment, Provider, ProviderError};
use clap::Parser;
use idempotent_core::http::{Config, ConfigBuilder};
use idempotent_core::{
    CommitPath, Engine, Store,
    engine::{Drained, ReplayCache},
};
use idempotent_core::{DeriveSecret, DerivedKey, IdempotencyKey, Idempotent, Scope};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// A charges API whose POSTs are safe to retry with an `Idempotency-Key`.
#[derive(Debug, Parser)]
#[command(version)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    pub listen: String,
    /// `sqlite://FILE` (created and migrated), `sqlite::memory:`, `memory`, `postgres://…`,
    /// `mysql://…` (MySQL or MariaDB; `mariadb://…` too), `redis://host:port` or
    /// `redis+cluster://host:port,…` (the records in Redis, the charges in this process's
    /// memory). Defaults to `$DATABASE_URL`, then `sqlite://charges.db`.
    #[arg(long)]
    pub database: Option<String>,
    /// Redis: how many replicas must acknowledge each claim and each stored response
    /// (`WAIT n 1000`) before the handler runs or the response is answered; default none.
    #[arg(long)]
    pub redis_wait: Option<u32>,
    /// How long a crashed attempt blocks retries (heartbeat-extended while a handler runs).
    #[arg(long, default_value = "30s", value_parser = charges::parse_lease)]
    pub lease: Duration,
    /// How long the "payment provider" takes per charge.
    #[arg(long, default_value = "0ms", value_parser = charges::parse_delay)]
    pub work_delay: Duration,
    /// How long a retry that arrives while the first attempt still runs waits for that
    /// attempt's answer (then replays it) before it gets 409; at most `--lease`. Default
    /// none (plain) or 50 ms (transactional).
    #[arg(long, value_parser = charges::parse_delay)]
    pub wait: Option<Duration>,
    /// Keep completed records in a local replay cache (64 MiB, 8 MiB per account, entries at
    /// most 5 s old): a retry of a finished charge is answered from memory, with no database
    /// round trip. A record deleted with `idempotent-admin` is then still replayed by this
    /// instance for up to those 5 s.
    #[arg(long)]
    pub replay_cache: bool,
    /// Transactional mode (SQLite, PostgreSQL, MySQL): `single` (the claim, the charge and the stored
    /// response in one commit) or `two` (the claim commits first). Default: single.
    #[arg(long, value_parser = parse_commit)]
    pub commit: Option<CommitPath>,
    /// SQLite, PostgreSQL, MySQL: plain mode instead of transactional (the charge commits on its own,
    /// apart from the stored response, as on `memory`). For comparison and the reliability
    /// tests: a process frozen past its lease can then still write its charge after a retry
    /// took over.
    #[arg(long, conflicts_with = "commit")]
    pub plain: bool,
    /// Serve the idempotency metrics at `GET /metrics`, in Prometheus' text format.
    #[arg(long)]
    pub metrics: bool,
    /// The secret downstream keys (the payment provider's idempotency keys) are derived
    /// under: at least 32 bytes, the same on every instance. Defaults to
    /// `$IDEMPOTENCY_SECRET`, then to a secret made once and kept in the database.
    #[arg(long)]
    pub derive_secret: Option<String>,
    /// Print `working` to stdout when a charge has been paid at the provider and written
    /// (inside its transaction), for tests that kill the server there.
    #[arg(long, hide = true)]
    pub announce_work: bool,
}

fn parse_commit(s: &str) -> Result<CommitPath, String> {
    match s {
        "single" => Ok(CommitPath::Single),
        "two" => Ok(CommitPath::Two),
        _ => Err(format!("`{s}` is not a commit path: use `single` or `two`")),
    }
}

impl Args {
    /// Whose handlers serve the POSTs on a database of `kind`: the plain handlers
    /// (`Kind::Memory`'s, writing through the pool) with `--plain`, else `kind`'s own.
    pub fn handlers(&self, kind: Kind) -> Kind {
        if self.plain { Kind::Memory } else { kind }
    }

    /// The database URL: the flag, else `$DATABASE_URL`, else `sqlite://charges.db`.
    pub fn database_url(&self) -> String {
        self.database
            .clone()
            .or_else(|| std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()))
            .unwrap_or_else(|| "sqlite://charges.db".to_owned())
    }
}

/// Resolves on SIGINT or SIGTERM. On Unix the handlers are installed when this is called, not
/// when the future is first polled: call it before announcing the address, so a signal sent the
/// moment the server says it listens is caught (and drains) instead of killing the process
/// (elsewhere Ctrl-C is caught from the future's first poll).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let (int, term) = {
        use tokio::signal::unix::{SignalKind, signal};
        (
            signal(SignalKind::interrupt()).ok(),
            signal(SignalKind::terminate()).ok(),
        )
    };
    async move {
        #[cfg(unix)]
        {
            let wait = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = wait(int) => {}
                () = wait(term) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// What a binary starts with: the API, the adapter's idempotency configuration `T` (whose
/// sweeper deletes expired records every minute from the first request on), and with
/// `--metrics` the handle rendering the metrics for `GET /metrics`.
#[derive(Debug)]
pub struct Started<T> {
    /// The routes' logic.
    pub api: Api,
    /// The adapter's configuration (`idempotent_axum::Idempotency` or the Actix one).
    pub idempotency: T,
    /// With `--metrics`: the Prometheus recorder's handle.
    pub metrics: Option<PrometheusHandle>,
}

/// Logs through `tracing-subscriber` to stderr, filtered by `RUST_LOG` (default `info`; the
/// idempotency spans need `RUST_LOG=info,idempotent_core=debug`). Stdout stays the binaries'
/// own (its first line is the address).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A line per span when it closes, with its fields (the idempotency span's outcome).
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .try_init();
}

/// Installs the Prometheus recorder of the `metrics` facade, with a thread that runs its
/// upkeep every 5 seconds (the recorder keeps histogram samples until then; without upkeep
/// they pile up between scrapes).
///
/// # Errors
/// A recorder is installed already.
pub fn install_metrics() -> Result<PrometheusHandle, String> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(5));
                upkeep.run_upkeep();
            }
        })
        .map_err(|e| format!("cannot start the metrics upkeep: {e}"))?;
    Ok(handle)
}

/// Opens the database and builds the idempotency configuration with `--lease`, after
/// setting up logging and, with `--metrics`, the metrics recorder. Errors are printed as
/// `NAME: …`.
///
/// # Errors
/// The exit code to end with.
pub async fn start<T: From<Config>>(
    name: &str,
    args: &Args,
) -> Result<Started<T>, std::process::ExitCode> {
    init_logging();
    let metrics = if args.metrics {
        match install_metrics() {
            Ok(handle) => Some(handle),
            Err(e) => {
                eprintln!("{name}: {e}");
                return Err(std::process::ExitCode::FAILURE);
            }
        }
    } else {
        None
    };
    let (api, store) = Api::open(args).await.map_err(|e| {
        eprintln!("{name}: cannot open {}: {e}", args.database_url());
        std::process::ExitCode::FAILURE
    })?;
    let secret = match api.derive_secret(args).await {
        Ok(secret) => secret,
        Err(e) => {
            eprintln!("{name}: {e}");
            return Err(std::process::ExitCode::FAILURE);
        }
    };
    let mut engine = Engine::builder_from_arc(store.clone())
        .lease(args.lease)
        .derive_secret(secret.clone());
    if args.replay_cache {
        engine = engine.replay_cache(ReplayCache::new());
    }
    let engine = engine.build().map_err(|e| {
        eprintln!("{name}: invalid configuration: {e}");
        std::process::ExitCode::FAILURE
    })?;
    let mut config = ConfigBuilder::<T>::new(engine);
    if let Some(commit) = args.commit {
        config = config.commit_path(commit);
    }
    if let Some(wait) = args.wait {
        config = config.wait(wait).transaction_wait(wait);
    }
    let idempotency = config.build().map_err(|e| {
        eprintln!("{name}: invalid configuration: {e}");
        std::process::ExitCode::FAILURE
    })?;
    // Last, so a start refused for another reason does not tie the database to its secret.
    if let Err(e) = api.check_secret(&secret).await {
        eprintln!("{name}: {e}");
        return Err(std::process::ExitCode::FAILURE);
    }
    Ok(Started {
        api,
        idempotency,
        metrics,
    })
}

/// Says what a drain left behind, if anything.
pub fn report_drain(name: &str, drained: Drained) {
    if drained.still_running + drained.dropped_unfinished > 0 {
        eprintln!(
            "{name}: {} executions still running after {DRAIN_TIMEOUT:?}, {} dropped unfinished; their keys stay in progress until their leases end",
            drained.still_running, drained.dropped_unfinished
        );
    }
}

/// The label of the payment provider's derived key: `idem.derive(PAYMENT_PROVIDER)`.
pub const PAYMENT_PROVIDER: &str = "payment-provider";

/// How long shutdown waits for running executions.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// An answer of the API: a JSON object, or an RFC 9457 problem for the API's own errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Whether the body is a problem (`application/problem+json`, `Cache-Control: no-store`).
    pub problem: bool,
    /// The JSON text.
    pub body: String,
}

impl Reply {
    fn json(status: u16, value: &impl serde::Serialize) -> Self {
        Reply {
            status,
            problem: false,
            body: serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned()),
        }
    }

    fn problem(status: u16, slug: &str, title: &str, detail: String) -> Self {
        // An application's own problem types are URIs it owns; `example.com` is reserved for
        // examples (RFC 2606), and an application puts its own domain here.
        let body = json!({
            "type": format!("https://example.com/problems/charges/{slug}"),
            "title": title,
            "status": status,
            "detail": detail,
        });
        Reply {
            status,
            problem: true,
            body: body.to_string(),
        }
    }

    /// The `Content-Type` of the body.
    pub fn content_type(&self) -> &'static str {
        if self.problem {
            "application/problem+json"
        } else {
            "application/json"
        }
    }

    /// 401: no usable `Authorization: Bearer <account>`.
    pub fn unauthorized() -> Self {
        Self::problem(
            401,
            "unauthorized",
            "Missing credentials",
            "send `Authorization: Bearer <account>`".into(),
        )
    }

    /// 500 for a failure inside a handler (so the key is released and a retry runs again).
    /// The error goes to the server's log, never into the response.
    fn internal(error: &dyn std::fmt::Display) -> Self {
        eprintln!("charges: internal error: {error}");
        Self::problem(
            500,
            "internal",
            "Internal error",
            "the request could not be processed; retry with the same key".into(),
        )
    }

    fn no_such_charge(id: &str) -> Self {
        Self::problem(
            404,
            "no-such-charge",
            "No such charge",
            format!("this account has no charge `{id}`"),
        )
    }
}

/// The authenticated caller from an `Authorization` header: `Bearer <account>`.
///
/// (A real service verifies the token here and takes the account it was issued to. The
/// idempotency scope must be such an authenticated identity, never a value the client picks
/// freely, or one client could replay another's stored responses.)
pub fn bearer_account(authorization: Option<&str>) -> Option<String> {
    authorization
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
}

/// A request body the API validates: a charge or a refund.
pub trait ApiBody: Sized {
    /// The 400 problem's title.
    const WHAT: &'static str;
    /// Parses and validates.
    ///
    /// # Errors
    /// Why the body is refused.
    fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, InvalidCharge>;
}

impl ApiBody for NewCharge {
    const WHAT: &'static str = "Invalid charge request";
    fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, InvalidCharge> {
        NewCharge::parse(content_type, body)
    }
}

impl ApiBody for NewRefund {
    const WHAT: &'static str = "Invalid refund request";
    fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, InvalidCharge> {
        NewRefund::parse(content_type, body)
    }
}

/// Validates a body (before any key is claimed: an invalid request is a 400 and a corrected
/// retry with the same key runs).
///
/// # Errors
/// The 400 problem.
pub fn validate<T: ApiBody>(content_type: Option<&str>, body: &[u8]) -> Result<T, Reply> {
    T::parse(content_type, body)
        .map_err(|e| Reply::problem(400, "invalid-request", T::WHAT, e.to_string()))
}

/// A value that identifies `secret` without revealing it: the key it derives for a fixed
/// scope, key and label.
fn secret_check(secret: &DeriveSecret) -> Result<String, Box<dyn std::error::Error>> {
    let scope = Scope::new("example")?;
    let key = IdempotencyKey::parse(b"derive-secret-check")?;
    Ok(Idempotent::keyed(secret, &scope, &key)
        .derive("check")
        .to_string())
}

/// What the routes do, on the database the store shares.
#[derive(Debug, Clone)]
pub struct Api {
    charges: Charges,
    provider: Provider,
    work_delay: Duration,
    announce_work: bool,
}

impl Api {
    /// Opens the database named by `args` (store migrated, tables created).
    ///
    /// # Errors
    /// Why it could not be opened.
    pub async fn open(args: &Args) -> Result<(Self, Arc<dyn Store>), charges::OpenError> {
        let url = args.database_url();
        let (store, charges) = charges::open(&url, args.redis_wait).await?;
        let provider = Provider::open(&url).await?;
        Ok((
            Api {
                charges,
                provider,
                work_delay: args.work_delay,
                announce_work: args.announce_work,
            },
            store,
        ))
    }

    /// The database kind: transactional handlers on SQLite, PostgreSQL and MySQL, plain on
    /// memory.
    pub fn kind(&self) -> Kind {
        self.charges.kind()
    }

    /// The derive secret: `--derive-secret`, `$IDEMPOTENCY_SECRET`, or the one kept in the
    /// database ([`charges::stored_secret`]).
    ///
    /// # Errors
    /// A message naming what is wrong.
    pub async fn derive_secret(&self, args: &Args) -> Result<DeriveSecret, String> {
        let given = args.derive_secret.clone().or_else(|| {
            std::env::var("IDEMPOTENCY_SECRET")
                .ok()
                .filter(|s| !s.is_empty())
        });
        let text = match given {
            Some(text) => text,
            None => charges::stored_secret(&self.charges)
                .await
                .map_err(|e| format!("cannot read the derive secret: {e}"))?,
        };
        DeriveSecret::new(text).map_err(|e| format!("invalid derive secret: {e}"))
    }

    /// Checks that `secret` is the one this database's instances use, recording it on the
    /// first start.
    ///
    /// # Errors
    /// A message naming what is wrong.
    pub async fn check_secret(&self, secret: &DeriveSecret) -> Result<(), String> {
        // Every instance on one database must derive the same keys, or a retry served by
        // another instance pays the provider again: the first start records a check value
        // (a key derived from a fixed input, which does not reveal the secret), and a start
        // with another secret is refused.
        let check = secret_check(secret).map_err(|e| format!("invalid derive secret: {e}"))?;
        match charges::agree_on_secret(&self.charges, &check).await {
            Ok(true) => Ok(()),
            Ok(false) => Err("the derive secret differs from the one this database's instances use (from `--derive-secret`, `IDEMPOTENCY_SECRET` or the one kept in the database); a retry served under another secret would pay the provider again. To rotate on purpose, read `DeriveSecret`'s notes, stop every instance, delete the row `derive_secret_check` of the table `example_settings`, then start them all with the new secret".to_owned()),
            Err(e) => Err(format!("cannot check the derive secret: {e}")),
        }
    }

    /// The payment provider's ledger (tests read it to count payments).
    pub fn provider(&self) -> &Provider {
        &self.provider
    }

    async fn work(&self) {
        if self.announce_work {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "working");
            let _ = out.flush();
        }
        // "Call the payment provider." (A zero sleep would still wait for the next timer tick.)
        if !self.work_delay.is_zero() {
            tokio::time::sleep(self.work_delay).await;
        }
    }

    /// `POST /v1/charges`: pays at the provider under `payment_key` (derived from the
    /// request's idempotency key, so a re-run of this handler gets the same payment back),
    /// then writes the charge through `w`; 201 with the charge. A provider failure is a 500,
    /// which releases the key: the retry runs again, under the same payment key.
    pub async fn create_charge(
        &self,
        mut w: Writer<'_>,
        account: &str,
        payment_key: DerivedKey,
        req: NewCharge,
    ) -> Reply {
        let mut charge = Charge::new(account, req);
        let key = payment_key.to_string();
        let asked = Payment {
            id: String::new(),
            account: account.to_owned(),
            customer: charge.customer.clone(),
            amount: charge.amount,
            currency: charge.currency.clone(),
        };
        match self.provider.pay(&key, &asked).await {
            Ok(payment) => charge.payment = Some(payment.id),
            // The provider saw this payment key before with other parameters: the client
            // reused its idempotency key for another charge once the first one's record was
            // gone (expired, or released after a failure). Retrying cannot help; a 422 is
            // stored and says so.
            Err(ProviderError::KeyReused) => {
                return Reply::problem(
                    422,
                    "payment-key-reused",
                    "Idempotency key reused",
                    "the payment provider already took a payment under this idempotency key with other parameters; use a new key for a new charge".into(),
                );
            }
            Err(e) => return Reply::internal(&e),
        }
        if let Err(e) = self.charges.insert(&mut w, &charge).await {
            return Reply::internal(&e);
        }
        self.work().await;
        Reply::json(201, &charge)
    }

    /// `POST /v1/charges/{charge}/refunds`: 201 with the refund, 404 for another account's or
    /// an unknown charge, 400 for more than the charge's amount.
    pub async fn create_refund(
        &self,
        mut w: Writer<'_>,
        account: &str,
        charge_id: &str,
        req: NewRefund,
    ) -> Reply {
        let charge = match self.charges.get(&mut w, account, charge_id).await {
            Ok(Some(charge)) => charge,
            Ok(None) => return Reply::no_such_charge(charge_id),
            Err(e) => return Reply::internal(&e),
        };
        let amount = req.amount.unwrap_or(charge.amount);
        if amount > charge.amount {
            return Reply::problem(
                400,
                "invalid-request",
                "Invalid refund request",
                format!("`amount` exceeds the charge's {}", charge.amount),
            );
        }
        let refund = Refund::new(&charge.id, amount);
        if let Err(e) = self.charges.insert_refund(&mut w, &refund).await {
            return Reply::internal(&e);
        }
        self.work().await;
        Reply::json(201, &refund)
    }

    /// `GET /v1/charges`: this account's charges, oldest first.
    pub async fn list_charges(&self, account: &str) -> Reply {
        match self.charges.list(account).await {
            Ok(data) => Reply::json(200, &json!({"object": "list", "data": data})),
            Err(e) => Reply::internal(&e),
        }
    }

    /// `GET /v1/charges/{charge}/refunds`: the charge's refunds, oldest first.
    pub async fn list_refunds(&self, account: &str, charge_id: &str) -> Reply {
        match self
            .charges
            .get(&mut Writer::Pool, account, charge_id)
            .await
        {
            Ok(Some(_)) => {}
            Ok(None) => return Reply::no_such_charge(charge_id),
            Err(e) => return Reply::internal(&e),
        }
        match self.charges.refunds(charge_id).await {
            Ok(data) => Reply::json(200, &json!({"object": "list", "data": data})),
            Err(e) => Reply::internal(&e),
        }
    }
}
