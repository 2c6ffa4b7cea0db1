//! The claim / heartbeat / take-over / complete / release protocol as a model that
//! [`stateright`] checks exhaustively (`tests/tests/model.rs`).
//!
//! # What is modelled
//! One (scope, key), one fingerprint (a different one is a 422 whatever the record holds, which
//! needs no model). Two servers, two clients that send the request (and retry it) to either
//! server, a store that keeps one record, and a clock that moves in ticks. Every step is one
//! atomic store operation, as the [`Store`](idempotent_core::Store) trait promises:
//!
//! - **claim**: absent record → claimed with a fresh token, lease `now + lease`; an
//!   `in_progress` record whose lease ran out → taken over with a fresh token (two commits,
//!   plain); anything else is a replay (done) or a 409 (in progress). The claim's answer can be
//!   lost: the store claimed, the server answered 503 and holds nothing.
//! - **start**: the server that got the claim starts the handler. A server can stall between
//!   its claim and this step (its claim's answer slow, the process paused) like anywhere else.
//! - **heartbeat**: a running server extends its lease, fenced by its token. A server that
//!   stops taking this step while the clock moves is a server frozen (a GC pause, SIGSTOP, a
//!   VM paused): the model explores every such schedule. Each server remembers when it last
//!   renewed its lease (its claim or its last heartbeat), on the model's own clock, so a
//!   take-over can be checked against the lease the protocol promises, not against what the
//!   store recorded.
//! - **silent renewal**: a renewal whose first attempt never answers (a pooled connection gone
//!   silent) while the handler runs on. The engine gives that attempt an eighth of the lease
//!   and sends a second one on another connection, which lands within seven sixteenths of the
//!   lease, so before the lease ends ([`Store::renew`](idempotent_core::Store::renew)): the
//!   step renews the lease like a heartbeat. (With [`SeededBug::UnboundedRenewal`] the
//!   heartbeat waits on that attempt for ever, renews nothing more, and the handler runs on.)
//! - **write**: the handler's side effect. Plain mode: it happens there and then. Transactional
//!   mode: it is staged in the server's transaction and commits only with the record.
//! - **finish**: the handler's outcome is stored (complete, fenced by the token) or releases
//!   the key (release, fenced). In transactional mode the complete and the business write are
//!   one commit, and a refused fence rolls both back. The response can be lost on its way
//!   to the client, which then retries.
//! - **crash** of a server at any step (kill -9): everything it held in memory is gone, an
//!   open transaction rolls back.
//! - **single commit**: the claim row is inside the handler's transaction, so a duplicate meets
//!   the uncommitted row and gets a 409; a crash rolls the claim back; the database ends a
//!   transaction that outlives its lease (PostgreSQL's `idle_in_transaction_session_timeout`,
//!   MySQL's `wait_timeout`), after which its commit fails.
//! - a client that gives up: every schedule in which it sends nothing more is explored (its
//!   requests are steps it may or may not take), so giving up needs no step of its own.
//! - **waiting duplicates** (with [`ProtocolModel::wait`]): a request that meets the record in
//!   progress waits at its server instead of a 409. It wakes at any step (a notification, a
//!   lost one and the capped poll, the lease's end: every schedule is explored) and claims
//!   again, answering with what that claim finds (the stored response, or running the handler
//!   after a release or a lapsed lease), or gives up at its deadline (409); its server can be
//!   killed while it waits.
//!
//! The record's ttl is not modelled: a key used after its record expired is a new request by
//! definition, so no invariant below spans it.
//!
//! # Invariants (checked on every reachable state)
//! [`STORED_NEVER_CHANGES`], [`REPLAY_EQUALS_STORED`], [`FENCED_WRITES_NEVER_LAND`],
//! [`NO_CLAIM_AFTER_STORED`], [`TAKEOVER_ONLY_AFTER_A_LEASE`], [`COMMITS_AT_MOST_ONCE`]
//! (transactional modes), [`OVERLAP_ONLY_AFTER_LOST_LEASE`],
//! [`NO_LEASE_LOST_TO_A_SILENT_RENEWAL`], [`WAITERS_ANSWER_ONLY_THE_STORED`], and
//! [`RUNS_NEVER_OVERLAP`]: the
//! last one fails, by design, in one way only, an owner frozen past its lease whose lease is
//! taken over (plain, two commits) or whose transaction the database ends (single commit) while
//! it still runs or has yet to start (documented in SECURITY.md); in the transactional modes
//! that overlap still commits once.

use stateright::{Model, Property};

/// A stored response is never overwritten, changed or deleted.
pub const STORED_NEVER_CHANGES: &str = "a stored response never changes";
/// Every replay a client gets equals the stored response.
pub const REPLAY_EQUALS_STORED: &str = "every replay equals the stored response";
/// A complete or release from a token that no longer holds the record changes nothing.
pub const FENCED_WRITES_NEVER_LAND: &str = "a write from a lost lease never lands";
/// Once a response is stored, no claim succeeds: retries replay it. (An owner frozen between
/// its claim and its handler can still start after a retry stored a response: that is the
/// overlap [`OVERLAP_ONLY_AFTER_LOST_LEASE`] admits, and such an execution has lost its lease.)
pub const NO_CLAIM_AFTER_STORED: &str = "no claim succeeds once a response is stored";
/// A running owner's lease is taken over (or its transaction ended) only after a whole lease
/// passed on the clock since it last renewed it.
pub const TAKEOVER_ONLY_AFTER_A_LEASE: &str =
    "a lease is lost only after a whole lease without renewal";
/// Transactional modes: the handler's business write commits at most once.
pub const COMMITS_AT_MOST_ONCE: &str = "the business write commits at most once";
/// Two executions of the key never run at the same time, and none starts once a response is
/// stored.
pub const RUNS_NEVER_OVERLAP: &str = "executions never overlap";
/// An owner whose renewal went unanswered never loses its lease for it: the engine gives up
/// on that attempt and renews on another connection while the lease still runs.
pub const NO_LEASE_LOST_TO_A_SILENT_RENEWAL: &str =
    "no lease is lost to a renewal that never answered";
/// A waiting duplicate is answered only with the record's stored response (or runs the
/// handler under a claim of its own): never with a response that is not the record's.
pub const WAITERS_ANSWER_ONLY_THE_STORED: &str =
    "a waiter is answered only with the stored response";
/// Reachable with waits: a waiter gets the stored response.
pub const SOME_WAITER_REPLAYS: &str = "a waiter gets the stored response";
/// Reachable (a `sometimes` property): a client gets a replay.
pub const SOME_REPLAY: &str = "a client gets a replay";
/// Reachable in plain and two-commit mode: a claim takes over a record.
pub const SOME_TAKEOVER: &str = "a claim takes over a record";
/// Executions overlap (or one starts after a response is stored) only where an owner that still
/// holds its claim (frozen) lost its lease: taken over (plain, two commits), or its
/// transaction ended by the database (single commit).
pub const OVERLAP_ONLY_AFTER_LOST_LEASE: &str =
    "executions overlap only after a frozen owner lost its lease";

/// How the handler's writes relate to the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// No transaction: the handler's side effects happen when it runs.
    Plain,
    /// The claim row inside the handler's transaction, one commit.
    SingleCommit,
    /// The claim commits first; the handler's writes and the complete commit together.
    TwoCommits,
}

/// A bug put in on purpose, to show the checker finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SeededBug {
    /// `complete` does not compare the caller's token with the record's (the fence skipped).
    SkipFenceOnComplete,
    /// `release` does not compare the caller's token with the record's.
    SkipFenceOnRelease,
    /// `claim` takes over an `in_progress` record whose lease has not run out.
    TakeOverLiveLease,
    /// The claim records a lease that ends at once (a unit mistake, a lease of zero).
    ZeroLease,
    /// Transactional modes: the handler's write commits on its own, before the complete.
    WriteCommitsAlone,
    /// One server's `claim` takes over a finished record as if it had expired (a ttl read
    /// wrong on that server).
    TakeOverDone,
    /// A renewal waits for its answer with no bound (the heartbeat before issue 49): one that
    /// never answers holds the heartbeat for good while the handler runs on.
    UnboundedRenewal,
    /// A woken waiter answers with the response of the execution whose end woke it, without
    /// claiming again (trusting the notification, not the store).
    WaiterTrustsTheNotification,
}

/// The model's bounds and variant.
#[derive(Debug, Clone)]
pub struct ProtocolModel {
    /// Plain, single commit or two commits.
    pub mode: Mode,
    /// Lease length in ticks.
    pub lease: u8,
    /// The clock stops at this tick (bounds the state space).
    pub horizon: u8,
    /// Requests each client sends at most (the first and its retries).
    pub attempts: u8,
    /// Server crashes at most, over the whole run.
    pub crashes: u8,
    /// A bug put in on purpose, or none.
    pub bug: Option<SeededBug>,
    /// How long a duplicate that meets the record in progress waits, in ticks (0: a 409 at
    /// once).
    pub wait: u8,
}

impl ProtocolModel {
    /// The bounded model CI checks for `mode`: lease 2 ticks, 6 ticks of time, 3 requests per
    /// client, two crashes.
    pub fn bounded(mode: Mode) -> Self {
        ProtocolModel {
            mode,
            lease: 2,
            horizon: 6,
            attempts: 3,
            crashes: 2,
            bug: None,
            wait: 0,
        }
    }

    /// The same model with duplicates that wait `wait` ticks for the first's answer.
    pub fn with_wait(mut self, wait: u8) -> Self {
        self.wait = wait;
        self
    }

    /// The same model with `bug` put in.
    pub fn with_bug(mut self, bug: SeededBug) -> Self {
        self.bug = Some(bug);
        self
    }
}

/// The one record the store holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rec {
    /// The token of the claim that holds it.
    pub token: u8,
    /// Tick at which the lease runs out (in progress only).
    pub lease_until: u8,
    /// The stored response (the number of the execution that produced it), once done.
    pub done: Option<u8>,
    /// Single commit: the server whose open transaction holds this (uncommitted) row.
    pub uncommitted_by: Option<u8>,
}

/// What a server is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Server {
    /// Waiting for a request.
    Idle,
    /// Holding a claim for `client` under `token`, the handler started or about to.
    Running {
        /// The client whose request this is.
        client: u8,
        /// The lease token the claim gave.
        token: u8,
        /// This execution's number (its response is this number).
        exec: u8,
        /// Whether the handler has started.
        started: bool,
        /// Whether the handler's write happened (plain) or is staged (transactional).
        wrote: bool,
        /// The tick of its claim or its last heartbeat that landed.
        renewed: u8,
        /// It lost its lease while it held it: taken over, or (single commit) its transaction
        /// ended by the database, so its commit will fail.
        lost: bool,
        /// Its heartbeat waits for a renewal, sent while its lease still ran, that will never
        /// answer (only with [`SeededBug::UnboundedRenewal`]).
        stuck: bool,
    },
    /// A duplicate of `client`'s request waits for the running attempt's answer until `until`.
    Waiting {
        /// The client whose request waits.
        client: u8,
        /// The tick of its deadline.
        until: u8,
    },
}

/// What a client has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Client {
    /// Requests sent so far.
    pub sent: u8,
    /// The first successful response it got (an execution's number), if any.
    pub answer: Option<u8>,
}

/// One state of the whole system, with the ghost variables the invariants read.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct State {
    /// The clock, in ticks.
    pub now: u8,
    /// The store's record.
    pub record: Option<Rec>,
    /// The next token a claim hands out.
    pub next_token: u8,
    /// The servers.
    pub servers: [Server; 2],
    /// The clients.
    pub clients: [Client; 2],
    /// Crashes so far.
    pub crashed: u8,
    /// Executions started so far (the last one's number).
    pub executions: u8,
    /// Business writes committed (transactional), or side effects done (plain).
    pub effects: u8,
    /// Ghost: the first response ever stored.
    pub first_stored: Option<u8>,
    /// Ghost: a stored response was overwritten, changed or deleted.
    pub stored_changed: bool,
    /// Ghost: a replay differed from the first stored response.
    pub bad_replay: bool,
    /// Ghost: a write under a token that no longer held the record changed it.
    pub stale_write_landed: bool,
    /// Ghost: a claim succeeded after a response was stored.
    pub claimed_after_stored: bool,
    /// Ghost: an owner lost its lease before a whole lease passed since it renewed it.
    pub lost_too_early: bool,
    /// Ghost: a handler started after a response was stored.
    pub late_start: bool,
    /// Ghost: a handler started after a response was stored, by an owner that had not lost
    /// its lease.
    pub late_start_holding_lease: bool,
    /// Ghost: a client got a replay.
    pub replayed: bool,
    /// Ghost: a claim took over a record (after a crash, a lost answer or a freeze).
    pub took_over: bool,
    /// Ghost: an owner whose heartbeat waited on a silent renewal lost its lease.
    pub lost_to_silent_renewal: bool,
    /// Ghost: the execution that finished last (stored or released), for the seeded bug.
    pub last_finished: Option<u8>,
    /// Ghost: a waiter was answered with something other than the stored response.
    pub waiter_bad_answer: bool,
    /// Ghost: a waiter got the stored response.
    pub waiter_replayed: bool,
}

/// One step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// The clock moves one tick.
    Tick,
    /// `client` sends its request to `server`; the claim's answer reaches the server unless
    /// `lost`.
    Request {
        /// Who sends.
        client: u8,
        /// Which server gets it.
        server: u8,
        /// The claim's answer is lost (the server answers 503).
        lost: bool,
    },
    /// `server` starts the handler it holds the claim for.
    Start(u8),
    /// `server`'s heartbeat extends its lease (fenced).
    Heartbeat(u8),
    /// `server`'s heartbeat sends a renewal that never answers (a silent connection): the
    /// engine gives up on it and renews on another connection, fenced, before the lease ends.
    SilentRenewal(u8),
    /// `server`'s handler does its write (plain: the side effect; transactional: staged).
    Write(u8),
    /// `server`'s handler finishes: its outcome is stored (`store`) or releases the key.
    Finish {
        /// Which server.
        server: u8,
        /// Stored outcome (2xx) or releasing one (5xx).
        store: bool,
        /// The response never reaches its client (it timed out, the connection broke): the
        /// client retries.
        lost: bool,
    },
    /// `server` is killed (kill -9).
    Crash(u8),
    /// Single commit: the database ends `server`'s transaction, which outlived its lease.
    KillTransaction(u8),
    /// The duplicate waiting at `server` wakes and claims again.
    Wake(u8),
    /// The duplicate waiting at `server` reaches its deadline: a 409.
    Deadline(u8),
}

impl ProtocolModel {
    /// With [`SeededBug::TakeOverDone`], whether `server` takes a finished record over.
    fn takes_done(&self, server: u8) -> bool {
        self.bug == Some(SeededBug::TakeOverDone) && server == 1
    }

    fn claimable(&self, rec: &Rec, now: u8, server: u8) -> bool {
        if rec.done.is_some() && self.takes_done(server) {
            return true;
        }
        let expired = rec.lease_until <= now;
        rec.done.is_none()
            && rec.uncommitted_by.is_none()
            && self.mode != Mode::SingleCommit
            && (expired || self.bug == Some(SeededBug::TakeOverLiveLease))
    }

    fn request(&self, s: &mut State, client: u8, server: u8, lost: bool) {
        s.clients[client as usize].sent += 1;
        self.claim(s, client, server, lost);
    }

    /// A waiter at `server` wakes.
    fn wake(&self, s: &mut State, server: u8) {
        let Server::Waiting { client, .. } = s.servers[server as usize] else {
            return;
        };
        if self.bug == Some(SeededBug::WaiterTrustsTheNotification)
            && let Some(finished) = s.last_finished
        {
            // Answered with what the notification named, the store unread.
            s.servers[server as usize] = Server::Idle;
            if s.record.and_then(|r| r.done) != Some(finished) {
                s.waiter_bad_answer = true;
            }
            let c = &mut s.clients[client as usize];
            c.answer = c.answer.or(Some(finished));
            return;
        }
        self.claim(s, client, server, false);
    }

    /// `client`'s request (new, or a woken waiter's) claims at `server`.
    fn claim(&self, s: &mut State, client: u8, server: u8, lost: bool) {
        let claimed_token = s.next_token;
        let waiter = matches!(s.servers[server as usize], Server::Waiting { .. });
        match s.record {
            Some(rec) if rec.done.is_some() && !self.takes_done(server) => {
                // A replay: the client gets the stored response.
                let stored = rec.done;
                if stored != s.first_stored {
                    s.bad_replay = true;
                    s.waiter_bad_answer |= waiter;
                }
                s.replayed = true;
                s.waiter_replayed |= waiter;
                s.servers[server as usize] = Server::Idle;
                if !lost {
                    let c = &mut s.clients[client as usize];
                    c.answer = c.answer.or(stored);
                }
                return;
            }
            Some(rec) if !self.claimable(&rec, s.now, server) => {
                // In progress: a 409, or (with a wait) waiting until the deadline.
                if self.wait > 0 && !lost {
                    let until = match s.servers[server as usize] {
                        Server::Waiting { until, .. } => until,
                        _ => s.now + self.wait,
                    };
                    s.servers[server as usize] = Server::Waiting { client, until };
                }
                return;
            }
            Some(rec) => {
                s.took_over = true;
                // A take-over: the old owner, if it still holds the claim, loses its lease.
                self.lose_lease(s, rec.token);
            }
            None => {}
        }
        s.next_token += 1;
        let lease = if self.bug == Some(SeededBug::ZeroLease) {
            0
        } else {
            self.lease
        };
        s.record = Some(Rec {
            token: claimed_token,
            lease_until: s.now + lease,
            done: None,
            uncommitted_by: (self.mode == Mode::SingleCommit).then_some(server),
        });
        if lost {
            // The store claimed; the server never heard. In single commit the claim was inside
            // the server's transaction, which the failed round trip rolls back.
            if self.mode == Mode::SingleCommit {
                s.record = None;
            }
            return;
        }
        if s.first_stored.is_some() {
            s.claimed_after_stored = true;
        }
        s.executions += 1;
        s.servers[server as usize] = Server::Running {
            client,
            token: claimed_token,
            exec: s.executions,
            started: false,
            wrote: false,
            renewed: s.now,
            lost: false,
            stuck: false,
        };
    }

    /// The owner holding `token`, if a server still holds it, loses its lease: checked against
    /// a whole lease since it last renewed it.
    fn lose_lease(&self, s: &mut State, token: u8) {
        let now = s.now;
        for server in &mut s.servers {
            if let Server::Running {
                token: held,
                renewed,
                lost,
                stuck,
                ..
            } = server
                && *held == token
            {
                if now < *renewed + self.lease {
                    s.lost_too_early = true;
                }
                if *stuck {
                    s.lost_to_silent_renewal = true;
                }
                *lost = true;
            }
        }
    }

    /// Whether `token` passes the fence of a write (complete, release, extend).
    fn fence_holds(&self, s: &State, token: u8, skip_token: bool) -> bool {
        matches!(s.record, Some(rec) if rec.done.is_none() && (skip_token || rec.token == token))
    }

    fn finish(&self, s: &mut State, server: u8, store: bool, lost: bool) {
        let Server::Running {
            client,
            token,
            exec,
            wrote,
            lost: killed,
            ..
        } = s.servers[server as usize]
        else {
            return;
        };
        s.servers[server as usize] = Server::Idle;
        s.last_finished = Some(exec);
        let transactional = self.mode != Mode::Plain;
        if !store {
            // A releasing outcome: the transaction (if any) rolls back; the fenced release
            // deletes the record.
            match self.mode {
                Mode::SingleCommit => {
                    if !killed {
                        s.record = None;
                    }
                }
                Mode::Plain | Mode::TwoCommits => {
                    // Refused by the fence: nothing changes.
                    let skip = self.bug == Some(SeededBug::SkipFenceOnRelease);
                    if self.fence_holds(s, token, skip) {
                        if s.record.is_some_and(|r| r.token != token) {
                            s.stale_write_landed = true;
                        }
                        s.record = None;
                    }
                }
            }
            return;
        }
        let skip = self.bug == Some(SeededBug::SkipFenceOnComplete);
        // Single commit: `killed` (the lease lost) means the database ended the transaction.
        let lands = match self.mode {
            Mode::SingleCommit => !killed && self.fence_holds(s, token, skip),
            Mode::Plain | Mode::TwoCommits => self.fence_holds(s, token, skip),
        };
        if !lands {
            // Refused: in transactional mode the business write rolls back with it.
            return;
        }
        let rec = s.record.expect("the fence held on a record");
        if rec.token != token {
            s.stale_write_landed = true;
        }
        if rec.done.is_some() {
            s.stored_changed = true;
        }
        s.record = Some(Rec {
            token: rec.token,
            lease_until: rec.lease_until,
            done: Some(exec),
            uncommitted_by: None,
        });
        match s.first_stored {
            None => s.first_stored = Some(exec),
            Some(first) if first != exec => s.stored_changed = true,
            Some(_) => {}
        }
        if transactional && wrote && self.bug != Some(SeededBug::WriteCommitsAlone) {
            s.effects += 1;
        }
        if !lost {
            let c = &mut s.clients[client as usize];
            c.answer = c.answer.or(Some(exec));
        }
    }
}

impl Model for ProtocolModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            record: None,
            next_token: 1,
            servers: [Server::Idle; 2],
            clients: [Client {
                sent: 0,
                answer: None,
            }; 2],
            crashed: 0,
            executions: 0,
            effects: 0,
            first_stored: None,
            stored_changed: false,
            bad_replay: false,
            stale_write_landed: false,
            claimed_after_stored: false,
            lost_too_early: false,
            late_start: false,
            late_start_holding_lease: false,
            replayed: false,
            took_over: false,
            lost_to_silent_renewal: false,
            last_finished: None,
            waiter_bad_answer: false,
            waiter_replayed: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.now < self.horizon {
            actions.push(Action::Tick);
        }
        for (c, client) in (0u8..).zip(&s.clients) {
            if client.answer.is_some() || client.sent >= self.attempts {
                continue;
            }
            for (srv, server) in (0u8..).zip(&s.servers) {
                if *server == Server::Idle {
                    actions.push(Action::Request {
                        client: c,
                        server: srv,
                        lost: false,
                    });
                    actions.push(Action::Request {
                        client: c,
                        server: srv,
                        lost: true,
                    });
                }
            }
        }
        for (srv, server) in (0u8..).zip(&s.servers) {
            if let Server::Waiting { until, .. } = *server {
                actions.push(Action::Wake(srv));
                if s.now >= until {
                    actions.push(Action::Deadline(srv));
                }
                if s.crashed < self.crashes {
                    actions.push(Action::Crash(srv));
                }
                continue;
            }
            let Server::Running {
                started,
                wrote,
                lost,
                stuck,
                ..
            } = *server
            else {
                continue;
            };
            if s.crashed < self.crashes {
                actions.push(Action::Crash(srv));
            }
            if self.mode == Mode::SingleCommit
                && !lost
                && s.record
                    .is_some_and(|r| r.uncommitted_by == Some(srv) && r.lease_until <= s.now)
            {
                actions.push(Action::KillTransaction(srv));
            }
            if !started {
                actions.push(Action::Start(srv));
                continue;
            }
            if self.mode != Mode::SingleCommit && !stuck {
                actions.push(Action::Heartbeat(srv));
                actions.push(Action::SilentRenewal(srv));
            }
            if !wrote {
                actions.push(Action::Write(srv));
            }
            for (store, lost) in [(true, false), (true, true), (false, false)] {
                actions.push(Action::Finish {
                    server: srv,
                    store,
                    lost,
                });
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => s.now += 1,
            Action::Request {
                client,
                server,
                lost,
            } => self.request(&mut s, client, server, lost),
            Action::Start(server) => {
                if let Server::Running { started, lost, .. } = &mut s.servers[server as usize] {
                    *started = true;
                    if s.first_stored.is_some() {
                        s.late_start = true;
                        s.late_start_holding_lease |= !*lost;
                    }
                }
            }
            Action::SilentRenewal(server) if self.bug == Some(SeededBug::UnboundedRenewal) => {
                // Stuck while its lease still ran: from here on the lease runs out with the
                // handler alive. (Sent after the lease ran out, it changes nothing: that owner
                // is a frozen one already.)
                let now = s.now;
                if let Server::Running { stuck, renewed, .. } = &mut s.servers[server as usize]
                    && now < *renewed + self.lease
                {
                    *stuck = true;
                }
            }
            // Bounded: the first attempt is given up on, the second lands, as a heartbeat.
            Action::Heartbeat(server) | Action::SilentRenewal(server) => {
                let now = s.now;
                if let Server::Running { token, .. } = s.servers[server as usize]
                    && self.fence_holds(&s, token, false)
                    && let Some(rec) = s.record.as_mut()
                {
                    rec.lease_until = now + self.lease;
                    if let Server::Running { renewed, .. } = &mut s.servers[server as usize] {
                        *renewed = now;
                    }
                }
            }
            Action::Write(server) => {
                if let Server::Running { wrote, .. } = &mut s.servers[server as usize] {
                    *wrote = true;
                    if self.mode == Mode::Plain || self.bug == Some(SeededBug::WriteCommitsAlone) {
                        s.effects += 1;
                    }
                }
            }
            Action::Finish {
                server,
                store,
                lost,
            } => self.finish(&mut s, server, store, lost),
            Action::Crash(server) => {
                s.crashed += 1;
                if self.mode == Mode::SingleCommit
                    && s.record.is_some_and(|r| r.uncommitted_by == Some(server))
                {
                    s.record = None;
                }
                s.servers[server as usize] = Server::Idle;
            }
            Action::Wake(server) => self.wake(&mut s, server),
            Action::Deadline(server) => s.servers[server as usize] = Server::Idle,
            Action::KillTransaction(server) => {
                if let Server::Running { token, .. } = s.servers[server as usize] {
                    self.lose_lease(&mut s, token);
                }
                if s.record.is_some_and(|r| r.uncommitted_by == Some(server)) {
                    s.record = None;
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(STORED_NEVER_CHANGES, |_: &Self, s: &State| {
                !s.stored_changed
                    && match (s.first_stored, s.record) {
                        (Some(first), Some(rec)) => rec.done == Some(first),
                        (Some(_), None) => false,
                        (None, _) => true,
                    }
            }),
            Property::always(REPLAY_EQUALS_STORED, |_: &Self, s: &State| !s.bad_replay),
            Property::always(FENCED_WRITES_NEVER_LAND, |_: &Self, s: &State| {
                !s.stale_write_landed
            }),
            Property::always(NO_CLAIM_AFTER_STORED, |_: &Self, s: &State| {
                !s.claimed_after_stored
            }),
            Property::always(TAKEOVER_ONLY_AFTER_A_LEASE, |_: &Self, s: &State| {
                !s.lost_too_early
            }),
            Property::always(RUNS_NEVER_OVERLAP, |_: &Self, s: &State| {
                running(s) <= 1 && !s.late_start
            }),
            Property::always(OVERLAP_ONLY_AFTER_LOST_LEASE, |_: &Self, s: &State| {
                (running(s) <= 1 || any_lost(s)) && !s.late_start_holding_lease
            }),
            Property::always(NO_LEASE_LOST_TO_A_SILENT_RENEWAL, |_: &Self, s: &State| {
                !s.lost_to_silent_renewal
            }),
            Property::always(WAITERS_ANSWER_ONLY_THE_STORED, |_: &Self, s: &State| {
                !s.waiter_bad_answer
            }),
        ];
        if self.wait > 0 {
            properties.push(Property::sometimes(
                SOME_WAITER_REPLAYS,
                |_: &Self, s: &State| s.waiter_replayed,
            ));
        }
        properties.push(Property::sometimes(SOME_REPLAY, |_: &Self, s: &State| {
            s.replayed
        }));
        properties.push(Property::sometimes(SOME_TAKEOVER, |_: &Self, s: &State| {
            s.took_over
        }));
        if self.mode != Mode::Plain {
            properties.push(Property::always(
                COMMITS_AT_MOST_ONCE,
                |_: &Self, s: &State| s.effects <= 1,
            ));
        }
        properties
    }
}

/// The state with servers and clients renamed to the smallest of its symmetric forms (the
/// checker's symmetry reduction: two servers, or two clients, swapped are the same system).
pub fn representative(s: &State) -> State {
    let swap_servers = |s: &State| {
        let mut t = s.clone();
        t.servers.swap(0, 1);
        if let Some(rec) = t.record.as_mut() {
            rec.uncommitted_by = rec.uncommitted_by.map(|b| 1 - b);
        }
        t
    };
    let swap_clients = |s: &State| {
        let mut t = s.clone();
        t.clients.swap(0, 1);
        for server in &mut t.servers {
            if let Server::Running { client, .. } | Server::Waiting { client, .. } = server {
                *client = 1 - *client;
            }
        }
        t
    };
    let b = swap_servers(s);
    let c = swap_clients(s);
    let d = swap_clients(&b);
    [s.clone(), b, c, d].into_iter().min().expect("four forms")
}

/// Handlers running right now.
pub fn running(s: &State) -> usize {
    s.servers
        .iter()
        .filter(|srv| matches!(srv, Server::Running { started: true, .. }))
        .count()
}

/// Whether a server still holding a claim has lost its lease.
pub fn any_lost(s: &State) -> bool {
    s.servers
        .iter()
        .any(|srv| matches!(srv, Server::Running { lost: true, .. }))
}
