//! What the stores that keep records as rows share (the SQL stores and Redis): times as epoch
//! milliseconds, the columns of an existing record and the claim's decision about it, and the
//! columns of a stored outcome.

use crate::fingerprint::Fingerprint;
use crate::store::fence::{Lease, LeaseToken};
use crate::store::record::{Record, RecordKey, RecordState, StoredOutcome, StoredResponse};
use crate::store::{ClaimOutcome, StoreError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Whole milliseconds, rounded up: a lease of 0.5 ms must not become 0 (an expired lease).
pub(crate) fn millis(d: Duration) -> i64 {
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    i64::try_from(ms).unwrap_or(i64::MAX)
}

pub(crate) fn from_millis(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// An existing row as the claim statement reports it, with its times already compared
/// against the database clock.
#[derive(Debug)]
pub(crate) struct ExistingRow {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) done: bool,
    pub(crate) token: uuid::Uuid,
    pub(crate) expired: bool,
    pub(crate) lease_over: bool,
    /// In progress: what is left of the lease; done: what is left of the record's life (the
    /// statements compute `COALESCE(locked_until, expires_at) - now`: a done record has no
    /// lease).
    pub(crate) retry_ms: i64,
    pub(crate) status: Option<i32>,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) body: Option<Vec<u8>>,
    pub(crate) oversized: Option<i64>,
}

/// What to do about an existing row.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Report this to the caller; for a replay, how long the record still lives.
    Report(ClaimOutcome, Option<Duration>),
    /// Take the row over (ttl passed, or lease ran out with the same fingerprint), fenced on
    /// the old token.
    TakeOver(LeaseToken),
}

/// The claim's decision about a row that already exists, in the order that matters: an expired
/// record is absent whatever its fingerprint; then another request's record is a mismatch;
/// then a finished one replays; then a run-out lease is taken over; else it is in progress.
pub(crate) fn decide(row: ExistingRow, fingerprint: &Fingerprint) -> Result<Decision, StoreError> {
    if row.expired {
        return Ok(Decision::TakeOver(LeaseToken::from_uuid(row.token)));
    }
    let stored = Fingerprint::from_stored(&row.fingerprint)
        .ok_or_else(|| StoreError::Corrupt("stored fingerprint has a bad length".into()))?;
    if !fingerprint.matches_stored(&stored) {
        return Ok(Decision::Report(
            ClaimOutcome::Mismatch {
                in_progress: !row.done,
            },
            None,
        ));
    }
    if row.done {
        // A record fingerprinted by another version matched by key alone: not reported as
        // keepable (a cache would match it by the request's digest instead).
        let lives = (stored.version() == fingerprint.version())
            .then(|| Duration::from_millis(u64::try_from(row.retry_ms).unwrap_or(0)));
        return Ok(Decision::Report(
            ClaimOutcome::Replay(stored_outcome(
                row.status,
                row.headers,
                row.body,
                row.oversized,
            )?),
            lives,
        ));
    }
    if row.lease_over {
        return Ok(Decision::TakeOver(LeaseToken::from_uuid(row.token)));
    }
    // Not over, so something is left even where the statement rounded it to 0 ms (a lease
    // with under half a millisecond to go): at least 1 ms, never "retry now" while it is held.
    Ok(Decision::Report(
        ClaimOutcome::InProgress {
            retry_after: Duration::from_millis(u64::try_from(row.retry_ms).unwrap_or(0).max(1)),
        },
        None,
    ))
}

pub(crate) fn claimed(token: LeaseToken, locked_until_ms: i64, took_over: bool) -> ClaimOutcome {
    ClaimOutcome::Claimed(Lease {
        token,
        locked_until: from_millis(locked_until_ms),
        took_over,
    })
}

pub(crate) fn stored_outcome(
    status: Option<i32>,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
    oversized: Option<i64>,
) -> Result<StoredOutcome, StoreError> {
    let status = status
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| StoreError::Corrupt("done record without a valid status".into()))?;
    if let Some(size) = oversized {
        return Ok(StoredOutcome::Oversized {
            status,
            size: u64::try_from(size).unwrap_or(0),
        });
    }
    let headers = StoredResponse::decode_headers(headers.as_deref().unwrap_or_default())
        .ok_or_else(|| StoreError::Corrupt("undecodable stored headers".into()))?;
    Ok(StoredOutcome::Response(StoredResponse {
        status,
        headers,
        body: body.unwrap_or_default(),
    }))
}

/// A whole row, as `Store::get` reads it (times in epoch milliseconds).
pub(crate) struct RecordColumns {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) done: bool,
    pub(crate) token: uuid::Uuid,
    pub(crate) locked_until: Option<i64>,
    pub(crate) status: Option<i32>,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) body: Option<Vec<u8>>,
    pub(crate) oversized: Option<i64>,
    pub(crate) created_at: i64,
    pub(crate) completed_at: Option<i64>,
    pub(crate) expires_at: i64,
}

pub(crate) fn build_record(key: &RecordKey, c: RecordColumns) -> Result<Record, StoreError> {
    let fingerprint = Fingerprint::from_stored(&c.fingerprint)
        .ok_or_else(|| StoreError::Corrupt("stored fingerprint has a bad length".into()))?;
    let state = if c.done {
        RecordState::Done {
            outcome: stored_outcome(c.status, c.headers, c.body, c.oversized)?,
            completed_at: from_millis(c.completed_at.unwrap_or_default()),
        }
    } else {
        RecordState::InProgress {
            token: LeaseToken::from_uuid(c.token),
            locked_until: from_millis(c.locked_until.unwrap_or_default()),
        }
    };
    Ok(Record {
        key: key.clone(),
        fingerprint,
        state,
        created_at: from_millis(c.created_at),
        expires_at: from_millis(c.expires_at),
    })
}

/// Column values for a completed record.
pub(crate) struct OutcomeColumns {
    pub(crate) status: i32,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) body: Option<Vec<u8>>,
    pub(crate) oversized: Option<i64>,
}

pub(crate) fn outcome_columns(outcome: &StoredOutcome) -> OutcomeColumns {
    match outcome {
        StoredOutcome::Response(r) => OutcomeColumns {
            status: i32::from(r.status),
            headers: Some(r.encode_headers()),
            body: Some(r.body.clone()),
            oversized: None,
        },
        StoredOutcome::Oversized { status, size } => OutcomeColumns {
            status: i32::from(*status),
            headers: None,
            body: None,
            oversized: Some(i64::try_from(*size).unwrap_or(i64::MAX)),
        },
    }
}
