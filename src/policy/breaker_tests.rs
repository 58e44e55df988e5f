//! The Redis breaker: opening, probing, closing.

use super::*;

const MS: u64 = 1_000_000;

#[test]
fn opens_after_consecutive_failures_and_a_success_resets_the_count() {
    let mut b = Breaker::new(3, 1000);
    assert!(!b.on_failure(0));
    assert!(!b.on_failure(0));
    b.on_success();
    assert!(!b.on_failure(0));
    assert!(!b.on_failure(0));
    assert_eq!(b.admit(0), Admission::Call);
    assert!(b.on_failure(5 * MS), "third consecutive failure opens it");
    assert_eq!(b.admit(6 * MS), Admission::Refuse);
    assert!(!b.is_closed());
}

#[test]
fn one_probe_after_the_open_period_closes_or_reopens_it() {
    let mut b = Breaker::new(1, 1000);
    assert!(b.on_failure(0));
    assert_eq!(b.admit(999 * MS), Admission::Refuse);
    assert_eq!(b.admit(1000 * MS), Admission::Probe);
    assert_eq!(b.admit(1001 * MS), Admission::Refuse, "one probe at a time");
    assert!(b.on_failure(1500 * MS), "a failed probe reopens");
    assert_eq!(b.admit(2499 * MS), Admission::Refuse);
    assert_eq!(b.admit(2500 * MS), Admission::Probe);
    b.on_success();
    assert_eq!(b.admit(2501 * MS), Admission::Call);
    assert!(b.is_closed());
}

#[test]
fn zero_failures_disables_it() {
    let mut b = Breaker::new(0, 1000);
    for _ in 0..100 {
        assert!(!b.on_failure(0));
    }
    assert_eq!(b.admit(0), Admission::Call);
}

#[test]
fn a_stall_opens_it_at_once_unless_disabled() {
    let mut b = Breaker::new(3, 1000);
    assert_eq!(b.on_stall(10 * MS), Some(1010 * MS), "no need for two more slow calls");
    assert_eq!(b.open_until(), None, "half-open: its probe goes out at once");
    assert_eq!(b.admit(11 * MS), Admission::Refuse);
    assert_eq!(b.on_stall(12 * MS), None, "already open");
    // The probe answered: closed, however early.
    b.on_success();
    assert_eq!(b.admit(13 * MS), Admission::Call);
    // The probe failed (the Redis timeout): open for open_ms, then another probe.
    assert!(b.on_stall(20 * MS).is_some());
    assert!(b.on_failure(3020 * MS));
    assert_eq!(b.admit(4019 * MS), Admission::Refuse);
    assert_eq!(b.admit(4020 * MS), Admission::Probe);
    assert_eq!(Breaker::new(0, 1000).on_stall(0), None, "breakerFailures 0 disables the breaker");
}
