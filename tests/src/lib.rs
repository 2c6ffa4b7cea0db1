//! Cross-crate suites of `idempotent`.
//!
//! [`conformance`] is the one store conformance suite every [`Store`] must pass; the
//! [`conformance_suite!`] macro stamps it out as one `#[tokio::test]` per case for a fixture.

use idempotent_core::Store;
use std::sync::Arc;
use std::time::Duration;

pub mod conformance;
pub mod execute;
pub mod faults;
pub mod fixtures;
pub mod model;
pub mod side_by_side;
pub mod stall;

/// A store under test, as the conformance suite drives it.
#[async_trait::async_trait]
pub trait Fixture: Send + Sync + 'static {
    /// A fresh, empty store that no other test sees (new table, new database or new map).
    async fn fresh(&self) -> Arc<dyn Store>;
    /// Lets the store's clock move forward by at least `by` (a manual clock, or a real sleep
    /// for stores that use the database clock).
    async fn advance(&self, by: Duration);
    /// The lease the suite uses: short where `advance` really sleeps.
    fn lease(&self) -> Duration {
        Duration::from_millis(400)
    }
    /// Drops what [`Fixture::fresh`] created (tables), after a case passed.
    async fn cleanup(&self) {}
}

/// Checks that `listed` names exactly the public cases of `src/conformance.rs`.
///
/// # Panics
/// When a case is missing from the list, or the list names something that is not a case.
pub fn assert_all_cases_registered(listed: &[&str]) {
    let source = include_str!("conformance.rs");
    let mut defined: Vec<&str> = source
        .lines()
        .filter_map(|l| l.strip_prefix("pub async fn "))
        .filter_map(|l| l.split('(').next())
        .collect();
    let mut listed = listed.to_vec();
    defined.sort_unstable();
    listed.sort_unstable();
    assert!(!defined.is_empty(), "no cases found in conformance.rs");
    assert_eq!(defined, listed, "conformance cases defined vs registered");
}

/// Stamps out the conformance suite as tests: `conformance_suite!(memory, fixture_expr);`
/// optionally followed by attributes for every test (such as `#[ignore = "…"]`).
#[macro_export]
macro_rules! conformance_suite {
    ($name:ident, $fixture:expr $(, #[$attr:meta])* ) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@list $fixture, [$(#[$attr])*],
                new_claim, replay_returns_stored_outcome, in_progress_reports_retry_after,
                mismatch_done, mismatch_in_progress, lease_takeover, lease_takeover_needs_same_fingerprint,
                fencing_after_takeover, ttl_expiry_reclaims, scope_isolation, scope_and_key_never_collide, delete_needs_force_for_in_progress, purge_in_batches,
                release_frees_key, extend_keeps_lease, stale_token_on_absent_record,
                oversized_marker_round_trips, concurrent_claims_one_winner,
                headers_and_binary_body_round_trip, other_fingerprint_versions_match_by_key_alone,
                replays_report_what_is_left_of_their_record);
        }
    };
    // The one list: every case becomes a test, and a last test checks the list against the
    // cases `conformance.rs` defines, so a new case cannot be forgotten.
    (@list $fixture:expr, [$($attrs:tt)*], $($case:ident),* $(,)?) => {
        $crate::conformance_suite!(@cases $fixture, [$($attrs)*], $($case),*);
        #[test]
        fn every_case_is_registered() {
            $crate::assert_all_cases_registered(&[$(stringify!($case)),*]);
        }
    };
    (@cases $fixture:expr, [$($attrs:tt)*], ) => {};
    (@cases $fixture:expr, [$($attrs:tt)*], $case:ident $(, $rest:ident)*) => {
        $($attrs)*
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $case() {
            let fixture = $fixture;
            $crate::conformance::$case(&fixture).await;
            $crate::Fixture::cleanup(&fixture).await;
        }
        $crate::conformance_suite!(@cases $fixture, [$($attrs)*], $($rest),*);
    };
}
