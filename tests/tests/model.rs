//! The protocol, model-checked (`tests/src/model.rs`): every reachable state of two servers,
//! two retrying clients, crashes, lost answers, frozen owners and lease expiry, in each mode,
//! with the invariants SECURITY.md states; and two bugs put in on purpose, which the checker
//! must find.

use idempotent_tests::model::{
    Action, COMMITS_AT_MOST_ONCE, FENCED_WRITES_NEVER_LAND, Mode, NO_RUN_AFTER_STORED,
    OVERLAP_ONLY_AFTER_LOST_LEASE, ProtocolModel, REPLAY_EQUALS_STORED, RUNS_NEVER_OVERLAP,
    SOME_REPLAY, SOME_TAKEOVER, STORED_NEVER_CHANGES, SeededBug, Server, State, representative,
    running,
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

/// The invariants that hold in every mode.
const SAFE: [&str; 4] = [
    STORED_NEVER_CHANGES,
    REPLAY_EQUALS_STORED,
    FENCED_WRITES_NEVER_LAND,
    NO_RUN_AFTER_STORED,
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

/// The counterexample of "executions never overlap" is an owner still running after its
/// lease ran out on the clock with no heartbeat (a frozen owner), and lost: returns it as text.
fn assert_frozen_owner(mode: Mode, path: &Path<State, Action>) -> String {
    let (steps, state) = cut(path, |s| running(s) >= 2);
    let shown = show(&steps);
    assert!(
        state.owner_lost_lease,
        "{mode:?}: the overlap is not a frozen owner's: {shown}"
    );
    assert!(
        steps.contains(&Action::Tick),
        "{mode:?}: a lease ran out without the clock moving: {shown}"
    );
    let tokens: Vec<u8> = state
        .servers
        .iter()
        .filter_map(|s| match s {
            Server::Running { token, .. } => Some(*token),
            Server::Idle => None,
        })
        .collect();
    assert_eq!(tokens.len(), 2, "{shown}");
    // The second execution's claim holds the record; the first's token no longer does.
    let holder = state.record.expect("a record").token;
    assert!(
        tokens.contains(&holder) && tokens.iter().any(|t| *t != holder),
        "{mode:?}: one of the two holds the record and the other lost it: {shown}"
    );
    eprintln!("{mode:?}, the admitted overlap: {shown}");
    shown
}

#[test]
fn plain_mode_holds_its_invariants_and_admits_only_the_frozen_owner() {
    let checker = check(ProtocolModel::bounded(Mode::Plain));
    for property in SAFE {
        checker.assert_no_discovery(property);
    }
    checker.assert_no_discovery(OVERLAP_ONLY_AFTER_LOST_LEASE);
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
    let checker = check(ProtocolModel::bounded(Mode::TwoCommits));
    for property in SAFE {
        checker.assert_no_discovery(property);
    }
    checker.assert_no_discovery(COMMITS_AT_MOST_ONCE);
    checker.assert_no_discovery(OVERLAP_ONLY_AFTER_LOST_LEASE);
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
    let checker = check(ProtocolModel::bounded(Mode::SingleCommit));
    for property in SAFE {
        checker.assert_no_discovery(property);
    }
    checker.assert_no_discovery(COMMITS_AT_MOST_ONCE);
    checker.assert_no_discovery(OVERLAP_ONLY_AFTER_LOST_LEASE);
    assert!(checker.discovery(SOME_REPLAY).is_some());
    // The claim row is uncommitted, so nothing ever takes it over...
    assert!(checker.discovery(SOME_TAKEOVER).is_none());
    // ...but the database ends a transaction that outlives its lease, and a retry runs while
    // the frozen owner still holds its (now dead) transaction; its commit fails.
    let overlap = checker
        .discovery(RUNS_NEVER_OVERLAP)
        .expect("a frozen owner's transaction ended by the database lets a retry run");
    let (steps, state) = cut(&overlap, |s| running(s) >= 2);
    assert!(state.owner_lost_lease, "{}", show(&steps));
    assert!(
        steps
            .iter()
            .any(|a| matches!(a, Action::KillTransaction(_))),
        "{}",
        show(&steps)
    );
    eprintln!("SingleCommit, the admitted overlap: {}", show(&steps));
}

#[test]
fn a_complete_without_its_fence_is_found() {
    for mode in [Mode::Plain, Mode::TwoCommits] {
        let checker = check_until(
            ProtocolModel::bounded(mode).with_bug(SeededBug::SkipFenceOnComplete),
            HasDiscoveries::AnyOf([FENCED_WRITES_NEVER_LAND].into()),
        );
        let found = checker
            .discovery(FENCED_WRITES_NEVER_LAND)
            .unwrap_or_else(|| panic!("{mode:?}: the unfenced complete was not found"));
        let (steps, _) = cut(&found, |s| s.stale_write_landed);
        eprintln!("{mode:?}, complete without its fence: {}", show(&steps));
    }
}

#[test]
fn a_claim_that_takes_over_a_live_lease_is_found() {
    let checker = check_until(
        ProtocolModel::bounded(Mode::Plain).with_bug(SeededBug::TakeOverLiveLease),
        HasDiscoveries::AnyOf([OVERLAP_ONLY_AFTER_LOST_LEASE].into()),
    );
    let found = checker
        .discovery(OVERLAP_ONLY_AFTER_LOST_LEASE)
        .expect("an overlap with no frozen owner is found");
    let (steps, _) = cut(&found, |s| running(s) >= 2 && !s.owner_lost_lease);
    eprintln!("take-over of a live lease: {}", show(&steps));
}
