//! A circuit breaker for the shared Redis: after `failures` consecutive failed or slow calls,
//! requests are decided without Redis for `open_ms`; then one probe call is let through, and its
//! success closes the breaker again (its failure reopens it). When a slow call finds that Redis
//! answered nothing at all while it waited (a stall), it opens at once with its probe sent at once.
//!
//! Why: with a frozen Redis (SIGSTOP, a long fork, a partition that drops packets) every call waits
//! for the Redis timeout (3 s by default) before normal balancing. The breaker bounds that cost to
//! the few calls that detect the stall.

/// Whether a call to Redis may be made now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Closed: call Redis.
    Call,
    /// The breaker was open long enough: this call is the probe that decides whether it closes.
    Probe,
    /// Open (or a probe is already out): decide without Redis.
    Refuse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed { consecutive_failures: u32 },
    Open { until_ns: u64 },
    HalfOpen,
}

/// See the module docs. `failures == 0` disables the breaker (every call is admitted).
#[derive(Debug, Clone)]
pub struct Breaker {
    failures: u32,
    open_ns: u64,
    state: State,
    /// When it last closed after being open (ns; 0 = never opened).
    closed_at_ns: u64,
}

impl Breaker {
    /// A closed breaker that opens after `failures` consecutive failures for `open_ms`.
    pub fn new(failures: u32, open_ms: u32) -> Breaker {
        Breaker {
            failures,
            open_ns: u64::from(open_ms) * 1_000_000,
            state: State::Closed { consecutive_failures: 0 },
            closed_at_ns: 0,
        }
    }

    /// Asks to make a call at `now_ns`.
    pub fn admit(&mut self, now_ns: u64) -> Admission {
        match self.state {
            State::Closed { .. } => Admission::Call,
            State::Open { until_ns } if now_ns >= until_ns => {
                self.state = State::HalfOpen;
                Admission::Probe
            }
            State::Open { .. } | State::HalfOpen => Admission::Refuse,
        }
    }

    /// True while calls are refused or a probe is out (releases wait instead of being sent).
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed { .. })
    }

    /// True while its probe is out (half-open).
    pub fn is_probing(&self) -> bool {
        matches!(self.state, State::HalfOpen)
    }

    /// When an open breaker lets its probe through (`None` while closed or half-open).
    pub fn open_until(&self) -> Option<u64> {
        match self.state {
            State::Open { until_ns } => Some(until_ns),
            State::Closed { .. } | State::HalfOpen => None,
        }
    }

    /// Another worker's breaker on the same Redis opened until `until_ns`: a closed breaker opens
    /// until then too (it would find the same stall with its own failed calls). Returns true when
    /// it opened.
    pub fn follow(&mut self, now_ns: u64, until_ns: u64) -> bool {
        if self.failures == 0 || until_ns <= now_ns || !self.is_closed() {
            return false;
        }
        self.state = State::Open { until_ns };
        true
    }

    /// A call was given up as too slow while Redis answered nothing at all, to any call, since it
    /// was sent: Redis is stalled, not slow on one call. Every call waiting now waits on the same
    /// stall, so waiting for `failures - 1` more of them tells nothing new and costs each request
    /// that arrives meanwhile the same wait. Opens the breaker now (unless it is disabled), with
    /// its probe out at once (see [`Breaker::is_probing`]): a call sent now is answered right
    /// after the stalled ones, so its answer says when the stall ends (a pause shorter than
    /// `open_ms`, a cluster failover's or a short fork's, would otherwise keep it open for all of
    /// `open_ms`). Not within `open_ms` of its last close: a Redis that is slow at every call,
    /// not stalled, looks the same to a pick that waits alone, and probing it at once would let a
    /// slow pick through every few hundred ms instead of once per `open_ms`. Returns until when
    /// the other workers should hold theirs open (they have no probe out), or `None` when it did
    /// not open.
    pub fn on_stall(&mut self, now_ns: u64) -> Option<u64> {
        if self.failures == 0 || !self.is_closed() {
            return None;
        }
        let until_ns = now_ns.saturating_add(self.open_ns);
        let reopened =
            self.closed_at_ns > 0 && now_ns.saturating_sub(self.closed_at_ns) < self.open_ns;
        self.state = if reopened { State::Open { until_ns } } else { State::HalfOpen };
        Some(until_ns)
    }

    /// Redis answered a call at `now_ns`.
    pub fn on_success(&mut self, now_ns: u64) {
        if !self.is_closed() {
            self.closed_at_ns = now_ns.max(1);
        }
        self.state = State::Closed { consecutive_failures: 0 };
    }

    /// A call failed (network error, timeout) or was given up as too slow. Returns true when this
    /// failure opened the breaker.
    pub fn on_failure(&mut self, now_ns: u64) -> bool {
        if self.failures == 0 {
            return false;
        }
        let open = match self.state {
            State::Closed { consecutive_failures } => {
                let n = consecutive_failures.saturating_add(1);
                self.state = State::Closed { consecutive_failures: n };
                n >= self.failures
            }
            State::HalfOpen => true,
            // Replies of calls sent before the breaker opened: it stays open as it is.
            State::Open { .. } => false,
        };
        if open {
            self.state = State::Open { until_ns: now_ns.saturating_add(self.open_ns) };
        }
        open
    }
}

#[cfg(test)]
#[path = "breaker_tests.rs"]
mod tests;
