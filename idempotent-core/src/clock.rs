//! Time, behind a trait so tests control it.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// A source of wall-clock time. The memory store reads it; SQL stores use the database clock.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> SystemTime;
}

/// The operating system's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that moves only when told to (for tests).
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let t0 = clock.now();
/// clock.advance(Duration::from_secs(5));
/// assert_eq!(clock.now().duration_since(t0).unwrap(), Duration::from_secs(5));
/// ```
#[derive(Debug)]
pub struct ManualClock(Mutex<SystemTime>);

impl ManualClock {
    /// Starts at the current system time.
    pub fn new() -> Self {
        ManualClock(Mutex::new(SystemTime::now()))
    }

    /// Moves time forward.
    pub fn advance(&self, by: Duration) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *t += by;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A clock offset from the system clock (to simulate skewed servers).
#[derive(Debug, Clone, Copy)]
pub struct SkewedClock {
    /// Added to the system time.
    pub ahead: Duration,
    /// Subtracted from the system time.
    pub behind: Duration,
}

impl Clock for SkewedClock {
    fn now(&self) -> SystemTime {
        SystemTime::now() + self.ahead - self.behind
    }
}
