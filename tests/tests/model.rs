//! The protocol, model-checked (`tests/src/model.rs`): every reachable state of two servers,
//! two retrying clients, crashes, lost answers, frozen owners and lease expiry, in each mode,
//! with the invariants SECURITY.md states; and bugs put in on purpose, which the checker must
//! find.

use idempotent_tests::model::{
    Action, COMMITS_AT_MOST_ONCE, FENCED_WRITES_NEVER_LAND, Mode, NO_CLAIM_AFTER_STORED,
    NO_LEASE_LOST_TO_A_SILENT_RENEWAL, OVERLAP_ONLY_AFTER_LOST_LEASE, ProtocolModel,
    REPLAY_EQUALS_STORED, RUNS_NEVER_OVERLAP, SOME_REPLAY, SOME_TAKEOVER, SOME_WAITER_REPLAYS,
    STORED_NEVER_CHANGES, SeededBug, Server, State, TAKEOVER_ONLY_AFTER_A_LEASE,
    WAITERS_ANSWER_ONLY_THE_STORED, any_lost, representative, running,
};
use stateright::{Checker, HasDiscoveries, Model, Path};

/// Explores every state of `model` reachable within its bounds (depth first, servers and
/// clients reduced by symmetry); prints the count.
fn check(model: ProtocolModel) -> impl Checker<ProtocolModel> {
    check_until(model, HasDiscoveries::All)
}

/// [`check`], stopping as soon as `until` holds (a bug's counterexample is found).
fn check_until(model: ProtocolModel, until: HasDiscoveries) -> impl Checker<ProtocolModel> {
    let label = format!("{:?} {:?}", model.mode, model.bug);
    let started = std::time::Instant::now();
    let checker = model
        .checker()
        .symmetry_fn(representative)
        .finish_when(until)
        .threads(2)
        .spawn_dfs()
        .join();
    assert!(
        checker.is_done(),
        "{label}: the checker stopped before the end"
    );
    eprintln!(
        "model {label}: {} unique states, {} generated, depth {}, {:.1?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker
}

/// The model of `mode` checked, with every property of [`SAFE`] asserted to hold.
fn checked_safe(mode: Mode) -> impl Checker<ProtocolModel> {
    checked_safe_model(ProtocolModel::bounded(mode))
}

/// `model` checked, with every property of [`SAFE`] asserted to hold.
fn checked_safe_model(model: ProtocolModel) -> impl Checker<ProtocolModel> {
    let checker = check(model);
    for property in SAFE {
        checker.assert_no_discovery(property);
    }
    checker
}

/// The invariants that hold in every mode.
const SAFE: [&str; 8] = [
    WAITERS_ANSWER_ONLY_THE_STORED,
    STORED_NEVER_CHANGES,
    REPLAY_EQUALS_STORED,
    FENCED_WRITES_NEVER_LAND,
    NO_CLAIM_AFTER_STORED,
    TAKEOVER_ONLY_AFTER_A_LEASE,
    OVERLAP_ONLY_AFTER_LOST_LEASE,
    NO_LEASE_LOST_TO_A_SILENT_RENEWAL,
];

/// The path up to its first state where `broken` holds: the steps, and that state.
fn cut(path: &Path<State, Action>, broken: impl Fn(&State) -> bool) -> (Vec<Action>, State) {
    let mut steps = Vec::new();
    for (state, action) in path.clone().into_vec() {
        if broken(&state) {
            return (steps, state);
        }
        steps.extend(action);
    }
    panic!(
        "the path never breaks the property: {}",
        show(&path.clone().into_actions())
    )
}

fn show(steps: &[Action]) -> String {
    steps
        .iter()
        .map(|a| format!("{a:?}"))
        .collect::<Vec<_>>()
        .join(" → ")
}

/// The counterexample of "executions never overlap" (two handlers at once, or one starting
/// after a response was stored) is an owner that lost its lease while it still held its claim,
/// after a whole lease on the clock without renewing it (frozen): returns it as text.
fn assert_frozen_owner(mode: Mode, path: &Path<State, Action>) -> String {
    let (steps, state) = cut(path, |s| running(s) >= 2 || s.late_start);
    let shown = show(&steps);
    assert!(
        any_lost(&state),
        "{mode:?}: no owner there lost its lease: {shown}"
    );
    assert!(
        steps.contains(&Action::Tick),
        "{mode:?}: a lease ran out without the clock moving: {shown}"
    );
    // The one that lost its lease no longer holds the record.
    for server in &state.servers {
        if let Server::Running {
            token, lost: true, ..
        } = server
        {
            assert!(
                state.record.is_none_or(|r| r.token != *token),
                "{mode:?}: the owner that lost its lease still holds the record: {shown}"
            );
        }
    }
    eprintln!("{mode:?}, the admitted overlap: {shown}");
    shown
}

#[test]
fn plain_mode_holds_its_invariants_and_admits_only_the_frozen_owner() {
    let checker = checked_safe(Mode::Plain);
    assert!(checker.discovery(SOME_REPLAY).is_some());
    assert!(checker.discovery(SOME_TAKEOVER).is_some());
    // The one duplicate the docs admit: found, and it is the frozen owner.
    let overlap = checker
        .discovery(RUNS_NEVER_OVERLAP)
        .expect("the model finds the admitted duplicate (a frozen owner's lease taken over)");
    assert_frozen_owner(Mode::Plain, &overlap);
}

#[test]
fn two_commits_commit_once_even_when_a_frozen_owner_is_taken_over() {
    let checker = checked_safe(Mode::TwoCommits);
    checker.assert_no_discovery(COMMITS_AT_MOST_ONCE);
    assert!(checker.discovery(SOME_REPLAY).is_some());
    assert!(checker.discovery(SOME_TAKEOVER).is_some());
    // Two executions may run (a frozen owner taken over), and still only one commits.
    let overlap = checker
        .discovery(RUNS_NEVER_OVERLAP)
        .expect("a frozen owner can be taken over in two-commit mode");
    assert_frozen_owner(Mode::TwoCommits, &overlap);
}

#[test]
fn single_commit_commits_once_even_when_a_frozen_owner_loses_its_transaction() {
    let checker = checked_safe(Mode::SingleCommit);
    checker.assert_no_discovery(COMMITS_AT_MOST_ONCE);
    assert!(checker.discovery(SOME_REPLAY).is_some());
    // The claim row is uncommitted, so nothing ever takes it over...
    assert!(checker.discovery(SOME_TAKEOVER).is_none());
    // ...but the database ends a transaction that outlives its lease, and a retry runs while
    // the frozen owner still holds its (now dead) transaction; its commit fails.
    let overlap = checker
        .discovery(RUNS_NEVER_OVERLAP)
        .expect("a frozen owner's transaction ended by the database lets a retry run");
    let shown = assert_frozen_owner(Mode::SingleCommit, &overlap);
    assert!(shown.contains("KillTransaction"), "{shown}");
}

/// Duplicates that wait for the first's answer (a wait as long as the lease, the longest
/// allowed): a waiter is answered only with the stored response, the other invariants hold as
/// without waits, and a waiter does get the stored response; a waiter that trusts the
/// notification instead of claiming again is caught.
#[test]
fn waiting_duplicates_answer_only_the_stored_response() {
    for mode in [Mode::Plain, Mode::TwoCommits] {
        // Two requests per client (a waiter is a retry that stays): every waiter outcome
        // (replay, running after a release or a lapsed lease, deadline, its server killed)
        // is reached with two; three multiplied the states by 7 and the time by 8 (29 s).
        let model = ProtocolModel {
            attempts: 2,
            ..ProtocolModel::bounded(mode)
        }
        .with_wait(2);
        let checker = checked_safe_model(model);
        assert!(checker.discovery(SOME_WAITER_REPLAYS).is_some(), "{mode:?}");
        if mode == Mode::TwoCommits {
            checker.assert_no_discovery(COMMITS_AT_MOST_ONCE);
        }
        let found = ProtocolModel::bounded(mode)
            .with_wait(2)
            .with_bug(SeededBug::WaiterTrustsTheNotification)
            .checker()
            .finish_when(HasDiscoveries::AnyOf(
                [WAITERS_ANSWER_ONLY_THE_STORED].into(),
            ))
            .spawn_bfs()
            .join()
            .discovery(WAITERS_ANSWER_ONLY_THE_STORED)
            .map(|path| show(&path.into_actions()));
        let found =
            found.unwrap_or_else(|| panic!("the seeded waiter bug was not found in {mode:?}"));
        eprintln!("WaiterTrustsTheNotification in {mode:?}: {found}");
    }
}

/// Bugs put in on purpose: each is found, as a counterexample of the invariant it breaks.
#[test]
fn seeded_bugs_are_found() {
    let cases = [
        (
            SeededBug::SkipFenceOnComplete,
            Mode::Plain,
            FENCED_WRITES_NEVER_LAND,
        ),
        (
            SeededBug::SkipFenceOnComplete,
            Mode::TwoCommits,
            FENCED_WRITES_NEVER_LAND,
        ),
        (
            SeededBug::SkipFenceOnRelease,
            Mode::Plain,
            FENCED_WRITES_NEVER_LAND,
        ),
        (
            SeededBug::SkipFenceOnRelease,
            Mode::TwoCommits,
            FENCED_WRITES_NEVER_LAND,
        ),
        (
            SeededBug::TakeOverLiveLease,
            Mode::Plain,
            TAKEOVER_ONLY_AFTER_A_LEASE,
        ),
        (
            SeededBug::TakeOverLiveLease,
            Mode::TwoCommits,
            TAKEOVER_ONLY_AFTER_A_LEASE,
        ),
        (
            SeededBug::ZeroLease,
            Mode::Plain,
            TAKEOVER_ONLY_AFTER_A_LEASE,
        ),
        (
            SeededBug::ZeroLease,
            Mode::SingleCommit,
            TAKEOVER_ONLY_AFTER_A_LEASE,
        ),
        (
            SeededBug::WriteCommitsAlone,
            Mode::TwoCommits,
            COMMITS_AT_MOST_ONCE,
        ),
        (
            SeededBug::WriteCommitsAlone,
            Mode::SingleCommit,
            COMMITS_AT_MOST_ONCE,
        ),
        (SeededBug::TakeOverDone, Mode::Plain, STORED_NEVER_CHANGES),
        (SeededBug::TakeOverDone, Mode::Plain, REPLAY_EQUALS_STORED),
        (SeededBug::TakeOverDone, Mode::Plain, NO_CLAIM_AFTER_STORED),
        (
            SeededBug::TakeOverDone,
            Mode::TwoCommits,
            COMMITS_AT_MOST_ONCE,
        ),
        (
            SeededBug::SkipFenceOnRelease,
            Mode::Plain,
            OVERLAP_ONLY_AFTER_LOST_LEASE,
        ),
        (
            SeededBug::UnboundedRenewal,
            Mode::Plain,
            NO_LEASE_LOST_TO_A_SILENT_RENEWAL,
        ),
        (
            SeededBug::UnboundedRenewal,
            Mode::TwoCommits,
            NO_LEASE_LOST_TO_A_SILENT_RENEWAL,
        ),
    ];
    for (bug, mode, property) in cases {
        // Breadth first, to the first counterexample: the shortest path that breaks it.
        let checker = ProtocolModel::bounded(mode)
            .with_bug(bug)
            .checker()
            .finish_when(HasDiscoveries::AnyOf([property].into()))
            .spawn_bfs()
            .join();
        let found = checker
            .discovery(property)
            .unwrap_or_else(|| panic!("{bug:?} in {mode:?} was not found by \"{property}\""));
        let model = checker.model();
        let holds = model.property(property).condition;
        let (steps, _) = cut(&found, |s| !holds(model, s));
        eprintln!(
            "{bug:?} in {mode:?} breaks \"{property}\": {}",
            show(&steps)
        );
    }
}
