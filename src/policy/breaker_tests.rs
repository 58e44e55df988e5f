//! The Redis breaker: opening, probing, closing.

use super::*;

const MS: u64 = 1_000_000;

#[test]
fn opens_after_consecutive_failures_and_a_success_resets_the_count() {
    let mut b = Breaker::new(3, 1000);
    assert!(!b.on_failure(0));
    assert!(!b.on_failure(0));
    b.on_success(0);
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
    b.on_success(2600 * MS);
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
    assert!(b.is_probing(), "its probe goes out at once");
    assert_eq!(b.admit(11 * MS), Admission::Refuse);
    assert_eq!(b.on_stall(12 * MS), None, "already open");
    // The probe answered: closed, however early.
    b.on_success(300 * MS);
    assert_eq!(b.admit(301 * MS), Admission::Call);
    // Stalled again within open_ms of that close: a Redis slow at every call looks the same, so
    // this time it stays open for open_ms before its probe, as after breakerFailures failures.
    assert_eq!(b.on_stall(600 * MS), Some(1600 * MS));
    assert!(!b.is_probing());
    assert_eq!(b.admit(1599 * MS), Admission::Refuse);
    assert_eq!(b.admit(1600 * MS), Admission::Probe);
    b.on_success(1700 * MS);
    // Long after: a stall probes at once again; a failed probe (the Redis timeout) opens it for
    // open_ms, then another probe.
    assert!(b.on_stall(3000 * MS).is_some());
    assert!(b.is_probing());
    assert!(b.on_failure(6000 * MS));
    assert_eq!(b.admit(6999 * MS), Admission::Refuse);
    assert_eq!(b.admit(7000 * MS), Admission::Probe);
    assert_eq!(Breaker::new(0, 1000).on_stall(0), None, "breakerFailures 0 disables the breaker");
}
