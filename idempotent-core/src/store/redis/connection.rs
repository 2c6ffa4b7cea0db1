//! The Redis store's connections: one server's reconnecting connection or the cluster
//! client's, replaced in the background after a failure that is not the server's own answer
//! ([`Rebuilt`]).

use super::redis_error;
use crate::store::StoreError;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use std::future::Future;
use std::time::Duration;

/// The connection: a reconnecting multiplexed connection to one server, or the cluster
/// client's (one multiplexed connection per node, following `MOVED`/`ASK` and refreshing its
/// slot map after a failover); each rebuilt after a failure (see [`Rebuilt`]).
#[derive(Clone)]
pub(super) enum Conn {
    Single(std::sync::Arc<Rebuilt<ConnectionManager>>),
    Cluster(std::sync::Arc<Rebuilt<ClusterConnection>>),
}

impl Conn {
    /// Another handle on the same connection.
    pub(super) fn share(&self) -> Conn {
        match self {
            Conn::Single(c) => Conn::Single(std::sync::Arc::clone(c)),
            Conn::Cluster(c) => Conn::Cluster(std::sync::Arc::clone(c)),
        }
    }
}

/// Opens a new connection of type `C`.
pub(super) type Connector<C> = Box<
    dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = redis::RedisResult<C>> + Send>> + Send + Sync,
>;

/// A connection and how to open another, which replaces it in the background after a
/// failure that is not the server's own answer (I/O, a timeout, a lost connection; see
/// [`needs_new_connection`]). Neither of the `redis` crate's connections recovers by itself
/// from every such failure:
/// - under load, its cluster connection did not recover from a primary killed with SIGKILL
///   (its requests to that shard kept timing out after the replica took over and the node came
///   back as a replica; measured for minutes): the new one reads the cluster's current slot
///   map from the seed nodes;
/// - its `ConnectionManager` reconnects when its connection is closed, not when it stops
///   answering: a connection that stays open but silent (a network that drops packets, a
///   half-open connection, a cluster connection stuck after a failover) would time out every
///   command until the operating system gave up on it, hours later.
///
/// Each connection has a generation. Only a failure on the current generation starts a
/// rebuild (a late failure on a connection already replaced does not replace its successor),
/// one rebuild runs at a time, and rebuilds start at most every `interval`
/// ([`REBUILD_INTERVAL`]).
pub(super) struct Rebuilt<C> {
    connect: Connector<C>,
    /// The current connection and its generation.
    current: std::sync::RwLock<(C, u64)>,
    /// The current generation, for those waiting for a new connection.
    generation: tokio::sync::watch::Sender<u64>,
    /// Whether a rebuild runs, and when the last one started.
    rebuilding: std::sync::Mutex<(bool, Option<std::time::Instant>)>,
    interval: Duration,
}

/// The shortest time between the starts of two rebuilds of one connection (a server that
/// refuses connections is not asked again at once by every failing command).
pub(super) const REBUILD_INTERVAL: Duration = Duration::from_millis(100);

/// Marks a rebuild of its connection as ended when dropped: when it finished, failed,
/// panicked, or its future was dropped unfinished (its runtime shut down, or none to run it).
pub(super) struct RebuildEnds<C>(std::sync::Arc<Rebuilt<C>>);

impl<C> Drop for RebuildEnds<C> {
    fn drop(&mut self) {
        self.0
            .rebuilding
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0 = false;
    }
}

impl<C: Clone + Send + Sync + 'static> Rebuilt<C> {
    pub(super) async fn connect(connect: Connector<C>) -> Result<Self, redis::RedisError> {
        let conn = connect().await?;
        Ok(Self::new(connect, conn, REBUILD_INTERVAL))
    }

    pub(super) fn new(connect: Connector<C>, conn: C, interval: Duration) -> Self {
        Rebuilt {
            connect,
            current: std::sync::RwLock::new((conn, 0)),
            generation: tokio::sync::watch::Sender::new(0),
            rebuilding: std::sync::Mutex::new((false, None)),
            interval,
        }
    }

    /// The current connection and its generation.
    pub(super) fn conn(&self) -> (C, u64) {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Rebuilds the connection in the background after a failure on generation `failed`,
    /// unless that connection was replaced already, a rebuild runs, or the last one started
    /// less than the interval ago.
    pub(super) fn rebuild(self: &std::sync::Arc<Self>, failed: u64) {
        {
            let mut state = self
                .rebuilding
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Checked under the lock: a rebuild that ends meanwhile changes the generation
            // before it clears `running`.
            if *self.generation.borrow() != failed {
                return;
            }
            let (running, last) = &mut *state;
            if *running || last.is_some_and(|t| t.elapsed() < self.interval) {
                return;
            }
            *running = true;
            *last = Some(std::time::Instant::now());
        }
        let ends = RebuildEnds(std::sync::Arc::clone(self));
        let rebuild = async move {
            let this = &ends.0;
            match (this.connect)().await {
                Ok(conn) => {
                    let generation = {
                        let mut current = this
                            .current
                            .write()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        *current = (conn, current.1 + 1);
                        current.1
                    };
                    this.generation.send_replace(generation);
                    tracing::info!("redis store: connection rebuilt after a failure");
                }
                Err(e) => {
                    tracing::warn!("redis store: rebuilding the connection failed: {e}");
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(rebuild)),
            // No runtime to run it on: dropped unstarted, it still ends the rebuild it marked.
            Err(_) => drop(rebuild),
        }
    }

    /// Whether generation `old` was replaced, or a rebuild runs.
    pub(super) fn replacing(&self, old: u64) -> bool {
        *self.generation.borrow() != old
            || self
                .rebuilding
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0
    }

    /// Waits until a connection newer than generation `old` is in place, at most until
    /// `deadline`, asking again every interval for a rebuild (one can fail, or be skipped
    /// for the interval); whether one is.
    pub(super) async fn replaced(
        self: &std::sync::Arc<Self>,
        old: u64,
        deadline: tokio::time::Instant,
    ) -> bool {
        let mut generation = self.generation.subscribe();
        loop {
            let every = self.interval.max(Duration::from_millis(1));
            let next = (tokio::time::Instant::now() + every).min(deadline);
            match tokio::time::timeout_at(next, generation.wait_for(|g| *g != old)).await {
                Ok(changed) => return changed.is_ok(),
                Err(_) if next >= deadline => return false,
                Err(_) => self.rebuild(old),
            }
        }
    }
}

/// The store error for a client error on generation `generation` of `conn`; a failure of the
/// connection rather than the server's answer also rebuilds it (see [`Rebuilt`]).
pub(super) fn failed(conn: &Conn, generation: u64, e: redis::RedisError) -> StoreError {
    if needs_new_connection(&e) {
        conn.rebuild(generation);
    }
    redis_error(e)
}

/// Whether `e` says the connection failed (I/O, a timeout, a lost or refused connection, a
/// reply it could not parse, a cluster node it has no connection to), not the server's own
/// answer: server errors the `redis` crate does not know by name (`WRONGTYPE`, `BUSY`, `OOM`,
/// `NOREPLICAS`) come as [`redis::ErrorKind::Extension`] and keep the connection.
pub(super) fn needs_new_connection(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_unrecoverable_error()
}

impl Conn {
    /// The current connection's generation (see [`Rebuilt`]).
    pub(super) fn generation(&self) -> u64 {
        match self {
            Conn::Single(c) => c.conn().1,
            Conn::Cluster(c) => c.conn().1,
        }
    }

    /// Whether generation `old` was replaced, or a rebuild runs.
    pub(super) fn replacing(&self, old: u64) -> bool {
        match self {
            Conn::Single(c) => c.replacing(old),
            Conn::Cluster(c) => c.replacing(old),
        }
    }

    /// Replaces the connection after a failure on generation `failed` (see [`Rebuilt`]).
    pub(super) fn rebuild(&self, failed: u64) {
        match self {
            Conn::Single(c) => c.rebuild(failed),
            Conn::Cluster(c) => c.rebuild(failed),
        }
    }

    /// Waits for a connection newer than generation `old`, at most until `deadline` (see
    /// [`Rebuilt::replaced`]).
    pub(super) async fn replaced(&self, old: u64, deadline: tokio::time::Instant) -> bool {
        match self {
            Conn::Single(c) => c.replaced(old, deadline).await,
            Conn::Cluster(c) => c.replaced(old, deadline).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    /// A connection that is only a number: the `n`th one opened; each opening waits for
    /// `gate` when there is one.
    fn numbered(
        interval: Duration,
        gate: Option<std::sync::Arc<tokio::sync::Semaphore>>,
    ) -> (
        std::sync::Arc<Rebuilt<u32>>,
        std::sync::Arc<std::sync::atomic::AtomicU32>,
    ) {
        let opened = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = std::sync::Arc::clone(&opened);
        let conn = Rebuilt::new(
            Box::new(move || {
                let (opened, gate) = (std::sync::Arc::clone(&opened), gate.clone());
                Box::pin(async move {
                    if let Some(gate) = gate {
                        gate.acquire().await.expect("open").forget();
                    }
                    Ok(opened.fetch_add(1, Ordering::SeqCst) + 1)
                })
            }),
            0,
            interval,
        );
        (std::sync::Arc::new(conn), counted)
    }

    fn soon() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(5)
    }

    #[tokio::test]
    async fn a_late_failure_of_a_replaced_connection_leaves_its_successor() {
        let (conn, opened) = numbered(Duration::ZERO, None);
        assert_eq!(conn.conn(), (0, 0));
        conn.rebuild(0);
        assert!(conn.replaced(0, soon()).await);
        assert_eq!(conn.conn(), (1, 1));
        conn.rebuild(0);
        tokio::task::yield_now().await;
        assert_eq!(conn.conn(), (1, 1));
        assert_eq!(opened.load(Ordering::SeqCst), 1, "a stale failure rebuilt");
        conn.rebuild(1);
        assert!(conn.replaced(1, soon()).await);
        assert_eq!(conn.conn(), (2, 2));
    }

    #[tokio::test]
    async fn rebuilds_wait_out_the_interval() {
        let (conn, opened) = numbered(Duration::from_secs(3600), None);
        conn.rebuild(0);
        assert!(conn.replaced(0, soon()).await);
        conn.rebuild(1);
        let waited = tokio::time::Instant::now() + Duration::from_millis(50);
        assert!(!conn.replaced(1, waited).await);
        assert_eq!(opened.load(Ordering::SeqCst), 1);
        assert_eq!(conn.conn(), (1, 1));
    }

    #[tokio::test]
    async fn one_rebuild_runs_at_a_time() {
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let (conn, opened) = numbered(Duration::ZERO, Some(std::sync::Arc::clone(&gate)));
        conn.rebuild(0);
        for _ in 0..5 {
            tokio::task::yield_now().await;
            conn.rebuild(0);
        }
        gate.add_permits(10);
        assert!(conn.replaced(0, soon()).await);
        for _ in 0..5 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            opened.load(Ordering::SeqCst),
            1,
            "rebuilds ran side by side"
        );
        assert_eq!(conn.conn(), (1, 1));
    }

    /// What a renewal that failed at once asks: is its connection being replaced (then it
    /// waits for the new one), or did the server refuse it (then it reports that)?
    #[tokio::test]
    async fn replacing_says_whether_a_failed_connection_is_being_replaced() {
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let (conn, _) = numbered(Duration::ZERO, Some(std::sync::Arc::clone(&gate)));
        assert!(!conn.replacing(0), "nothing failed");
        conn.rebuild(0);
        assert!(conn.replacing(0), "a rebuild runs");
        gate.add_permits(1);
        assert!(conn.replaced(0, soon()).await);
        assert!(conn.replacing(0), "generation 0 was replaced");
        assert!(
            !conn.replacing(1),
            "the new connection is not being replaced"
        );
    }

    #[test]
    fn a_rebuild_with_no_runtime_to_run_on_does_not_block_the_next() {
        let (conn, opened) = numbered(Duration::ZERO, None);
        conn.rebuild(0);
        assert!(
            !conn.rebuilding.lock().expect("lock").0,
            "left marked as running"
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            conn.rebuild(0);
            assert!(conn.replaced(0, soon()).await);
        });
        assert_eq!(opened.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_servers_own_errors_keep_the_connection() {
        use redis::{ErrorKind, RedisError};
        let io = |kind| RedisError::from(std::io::Error::from(kind));
        assert!(needs_new_connection(&io(std::io::ErrorKind::TimedOut)));
        assert!(needs_new_connection(&io(
            std::io::ErrorKind::ConnectionReset
        )));
        assert!(needs_new_connection(&RedisError::from((
            ErrorKind::ClusterConnectionNotFound,
            "no connection to the node"
        ))));
        for kept in [
            RedisError::from((ErrorKind::Extension, "WRONGTYPE", "not a hash".to_owned())),
            RedisError::from((ErrorKind::Extension, "BUSY", "a script runs".to_owned())),
            RedisError::from((ErrorKind::UnexpectedReturnType, "not an array")),
        ] {
            assert!(!needs_new_connection(&kept), "{kept}");
        }
    }
}
