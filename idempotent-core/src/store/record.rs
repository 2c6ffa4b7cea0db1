//! Records and stored responses (the lease that fences them is in `fence.rs`).

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::scope::Scope;
use crate::store::fence::LeaseToken;
use std::time::{Duration, SystemTime};

/// What a record is keyed by: (scope, idempotency key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordKey {
    /// The caller.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
}

impl RecordKey {
    /// Pairs a scope and a key.
    pub fn new(scope: Scope, key: IdempotencyKey) -> Self {
        RecordKey { scope, key }
    }
}

/// A response as stored and replayed: status, headers in order (repeats kept), body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// Header lines in order, names lower-cased; repeated names appear repeatedly.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body bytes.
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// A response with a status and a body and no headers.
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Self {
        StoredResponse {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// Adds a header line (builder style).
    #[must_use]
    pub fn with_header(mut self, name: &str, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.to_ascii_lowercase(), value.into()));
        self
    }

    /// Headers as one length-prefixed byte string (for SQL stores); see
    /// [`StoredResponse::decode_headers`].
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_headers_len());
        self.encode_headers_into(&mut out);
        out
    }

    /// The length of [`encode_headers`](Self::encode_headers)' output.
    pub(crate) fn encoded_headers_len(&self) -> usize {
        self.headers
            .iter()
            .map(|(n, v)| 8 + n.len() + v.len())
            .sum()
    }

    /// Appends [`encode_headers`](Self::encode_headers)' output to `out`.
    pub(crate) fn encode_headers_into(&self, out: &mut Vec<u8>) {
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.len() as u32).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value);
        }
    }

    /// Inverse of [`StoredResponse::encode_headers`]; `None` on corrupt input.
    pub fn decode_headers(mut bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
        fn take<'a>(bytes: &mut &'a [u8]) -> Option<&'a [u8]> {
            let len_bytes: [u8; 4] = bytes.get(..4)?.try_into().ok()?;
            let len = u32::from_be_bytes(len_bytes) as usize;
            let out = bytes.get(4..4 + len)?;
            *bytes = &bytes[4 + len..];
            Some(out)
        }
        let mut headers = Vec::new();
        while !bytes.is_empty() {
            let name = std::str::from_utf8(take(&mut bytes)?).ok()?.to_owned();
            let value = take(&mut bytes)?.to_vec();
            headers.push((name, value));
        }
        Some(headers)
    }
}

/// What a finished record holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredOutcome {
    /// A response to replay.
    Response(StoredResponse),
    /// The handler ran, but its response was larger than the route's limit, so it was not
    /// stored. Retries get a clear error instead of a second execution.
    Oversized {
        /// The status the handler answered with.
        status: u16,
        /// Body size in bytes (as far as it was read).
        size: u64,
    },
}

impl StoredOutcome {
    /// The handler's status code.
    pub fn status(&self) -> u16 {
        match self {
            StoredOutcome::Response(r) => r.status,
            StoredOutcome::Oversized { status, .. } => *status,
        }
    }
}

impl From<StoredResponse> for StoredOutcome {
    fn from(r: StoredResponse) -> Self {
        StoredOutcome::Response(r)
    }
}

/// The state of a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// An attempt holds the lease.
    InProgress {
        /// The holder's token.
        token: LeaseToken,
        /// When the lease runs out (store clock).
        locked_until: SystemTime,
    },
    /// The attempt finished; its outcome is replayed until the record expires.
    Done {
        /// What is replayed.
        outcome: StoredOutcome,
        /// When it finished (store clock).
        completed_at: SystemTime,
    },
}

/// A record as a store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// (scope, key).
    pub key: RecordKey,
    /// The fingerprint of the request that claimed it.
    pub fingerprint: Fingerprint,
    /// In progress or done.
    pub state: RecordState,
    /// When it was first claimed (store clock).
    pub created_at: SystemTime,
    /// After this instant (store clock) the record counts as absent.
    pub expires_at: SystemTime,
}

/// Seconds to tell a client in `Retry-After`: the remaining lease rounded up, at least 1.
pub fn retry_after_secs(remaining: Duration) -> u64 {
    let secs = remaining.as_secs() + u64::from(remaining.subsec_nanos() > 0);
    secs.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let r = StoredResponse::new(201, "x")
            .with_header("Set-Thing", "a")
            .with_header("set-thing", vec![0, 255])
            .with_header("x", "");
        let enc = r.encode_headers();
        assert_eq!(StoredResponse::decode_headers(&enc).unwrap(), r.headers);
        assert_eq!(StoredResponse::decode_headers(&enc[..enc.len() - 1]), None);
        assert_eq!(StoredResponse::decode_headers(&[]).unwrap(), vec![]);
    }

    #[test]
    fn retry_after() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }
}
