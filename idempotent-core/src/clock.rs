//! Time, behind a trait so tests control it.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// A source of time for the memory store (SQL stores use the database clock).
///
/// Two readings: a **monotonic** one ([`Clock::instant`]), which leases and expiry are
/// measured on, so a wall clock stepped backwards (by NTP or an operator) never extends a
/// lease and one stepped forwards never ends it early; and the **wall** time
/// ([`Clock::now`]), which only dates what records show (`created_at`, `completed_at`, and,
/// through the wall time read when the store was built, the lease end and expiry).
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current wall-clock time (for display).
    fn now(&self) -> SystemTime;

    /// The current monotonic reading: never goes back, unaffected by wall-clock steps.
    fn instant(&self) -> Instant;
}

/// The operating system's clocks: [`SystemTime::now`] and [`Instant::now`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn instant(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to (for tests).
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::{clock::Clock, clock::ManualClock};
///
/// let clock = ManualClock::new();
/// let (t0, i0) = (clock.now(), clock.instant());
/// clock.advance(Duration::from_secs(5));
/// assert_eq!(clock.now().duration_since(t0).unwrap(), Duration::from_secs(5));
/// // The wall clock steps back an hour; monotonic time does not move.
/// clock.set_wall_time(t0 - Duration::from_secs(3600));
/// assert_eq!(clock.instant() - i0, Duration::from_secs(5));
/// ```
#[derive(Debug)]
pub struct ManualClock(Mutex<(SystemTime, Instant)>);

impl ManualClock {
    /// Starts at the current system time.
    pub fn new() -> Self {
        ManualClock(Mutex::new((SystemTime::now(), Instant::now())))
    }

    /// Lets time pass: both readings move forward.
    pub fn advance(&self, by: Duration) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        t.0 += by;
        t.1 += by;
    }

    /// Steps the wall clock to `to` (as NTP or an operator would), forwards or backwards;
    /// the monotonic reading does not move.
    pub fn set_wall_time(&self, to: SystemTime) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).0 = to;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    fn instant(&self) -> Instant {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}

/// A clock whose wall time is offset from the system clock (to simulate skewed servers); its
/// monotonic reading is the system's.
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

    fn instant(&self) -> Instant {
        Instant::now()
    }
}
