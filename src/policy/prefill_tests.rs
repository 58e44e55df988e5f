//! The prefill backlog: what each pod still has to prefill of the prompts this worker sent it.

use super::*;

const S: u64 = 1_000_000_000;

fn placed(pod: &str, cached_blocks: usize) -> Option<Placement<'_>> {
    Some(Placement { pod, cached_blocks })
}

fn sorted(mut v: Vec<(String, u64)>) -> Vec<(String, u64)> {
    v.sort();
    v
}

#[test]
fn a_pod_owes_the_uncached_part_of_each_prompt_until_it_answers() {
    let mut b = PrefillBacklog::default();
    // A 3-block document sent to pod a (a miss), a 3-block follow-up to pod b that holds its
    // first 2 blocks, and a prompt whose pick has not come back yet.
    b.on_prompt(1, [40_000, 100, 60].into_iter(), 0);
    b.on_prompt(2, [5_000, 3_000, 200].into_iter(), 0);
    b.on_prompt(3, [9_999].into_iter(), 0);
    let place = |s: u32| match s {
        1 => placed("a", 0),
        2 => placed("b", 2),
        _ => None,
    };
    assert_eq!(sorted(b.per_pod(S, place)), vec![("a".into(), 40_160), ("b".into(), 200)]);
    // Pod a's first answer byte: its prefill is over.
    assert!(b.on_answered(1), "it was waiting");
    assert!(!b.on_answered(1), "once");
    assert_eq!(sorted(b.per_pod(S, place)), vec![("b".into(), 200)]);
}

#[test]
fn a_prompt_with_no_answer_for_a_minute_no_longer_counts() {
    let mut b = PrefillBacklog::default();
    b.on_prompt(1, [4096].into_iter(), 0);
    assert_eq!(b.per_pod(59 * S, |_| placed("a", 0)), vec![("a".into(), 4096)]);
    assert!(b.per_pod(60 * S, |_| placed("a", 0)).is_empty());
}

#[test]
fn the_tracked_prompts_stay_bounded_and_the_oldest_go_first() {
    let mut b = PrefillBacklog::default();
    for i in 0..(MAX_TRACKED as u32 + 10) {
        b.on_prompt(i, [1].into_iter(), u64::from(i));
    }
    assert_eq!(b.tracked(), MAX_TRACKED);
    let newest = MAX_TRACKED as u32 + 9;
    let counted = |s: u32| b.per_pod(S, |t| if t == s { placed("a", 0) } else { None });
    assert_eq!(counted(newest), vec![("a".into(), 1)], "the newest prompt is kept");
    assert!(counted(0).is_empty(), "the oldest went");
}

#[test]
fn a_prompt_of_many_blocks_keeps_a_bounded_record() {
    let mut b = PrefillBacklog::default();
    // 100000 one-message blocks (a 4 MiB body of tiny messages): only the first MAX_BLOCKS
    // cumulative sums are kept, as no pick can find more cached; the total stays whole.
    b.on_prompt(1, std::iter::repeat_n(10, 100_000), 0);
    assert!(b.prompts.get(&1).is_some_and(|p| p.cum.len() == MAX_BLOCKS));
    assert_eq!(b.per_pod(S, |_| placed("a", 0)), vec![("a".into(), 1_000_000)]);
    assert_eq!(b.per_pod(S, |_| placed("a", MAX_BLOCKS)), vec![("a".into(), 1_000_000 - 2_560)]);
}

fn backlog(pods: &[(&str, u64)]) -> Vec<(String, u64)> {
    pods.iter().map(|(p, b)| (p.to_string(), *b)).collect()
}

#[test]
fn each_worker_adds_what_the_other_workers_published() {
    use crate::host::fake::FakeHost;
    // Three worker VMs of one gateway share its shared data (one FakeHost).
    let mut host = FakeHost::new();
    let mut a = SharedBacklogs::new(&mut host);
    let mut b = SharedBacklogs::new(&mut host);
    let c = SharedBacklogs::new(&mut host);
    a.publish(&mut host, backlog(&[("p1", 48_000), ("p2", 0)]));
    b.publish(&mut host, backlog(&[("p1", 1_000), ("p3", 500)]));
    assert_eq!(sorted(c.others(&mut host)), backlog(&[("p1", 49_000), ("p3", 500)]));
    // A worker does not count itself.
    assert_eq!(sorted(a.others(&mut host)), backlog(&[("p1", 1_000), ("p3", 500)]));
    // a's prompt was answered: its value goes empty.
    a.publish(&mut host, Vec::new());
    assert_eq!(sorted(c.others(&mut host)), backlog(&[("p1", 1_000), ("p3", 500)]));
}

#[test]
fn a_worker_that_stopped_publishing_for_a_minute_no_longer_counts_and_leaves_the_list() {
    use crate::host::fake::FakeHost;
    use crate::host::Host;
    let mut host = FakeHost::new();
    let mut gone = SharedBacklogs::new(&mut host);
    let mut live = SharedBacklogs::new(&mut host);
    let reader = SharedBacklogs::new(&mut host);
    host.now = 0;
    gone.publish(&mut host, backlog(&[("p1", 9_000)]));
    host.now = 30 * S;
    live.publish(&mut host, backlog(&[("p2", 100)]));
    host.now = 59 * S;
    assert_eq!(sorted(reader.others(&mut host)), backlog(&[("p1", 9_000), ("p2", 100)]));
    // The worker gone with its VM (or all of whose prompts went unanswered) wrote nothing for a
    // minute: as its own prompts would be, it is forgotten, and dropped from the list.
    host.now = 60 * S;
    assert_eq!(reader.others(&mut host), backlog(&[("p2", 100)]));
    let listed = host.get_shared_data(WORKERS_KEY).0.unwrap_or_default();
    assert_eq!(String::from_utf8_lossy(&listed).lines().count(), 1, "only the live worker");
    // Publishing again lists it again.
    gone.publish(&mut host, backlog(&[("p1", 1)]));
    assert_eq!(sorted(reader.others(&mut host)), backlog(&[("p1", 1), ("p2", 100)]));
}

#[test]
fn an_unchanged_backlog_is_not_written_again_and_a_lost_listing_is_retried() {
    use crate::host::fake::FakeHost;
    use crate::host::Host;
    let mut host = FakeHost::new();
    let mut a = SharedBacklogs::new(&mut host);
    let reader = SharedBacklogs::new(&mut host);
    a.publish(&mut host, backlog(&[("p1", 5)]));
    let key = SharedBacklogs::key(&a.id);
    let cas = host.get_shared_data(&key).1;
    a.publish(&mut host, backlog(&[("p1", 5)]));
    assert_eq!(host.get_shared_data(&key).1, cas, "no write");
    // Another worker's unchecked first write (CAS 0 while the list did not exist) replaced the
    // list without a: its next publish lists it again, without writing its value.
    host.set_shared_data(WORKERS_KEY, b"someone", 0).unwrap();
    assert!(reader.others(&mut host).is_empty());
    a.publish(&mut host, backlog(&[("p1", 5)]));
    assert_eq!(reader.others(&mut host), backlog(&[("p1", 5)]));
    assert_eq!(host.get_shared_data(&key).1, cas, "no write");
}
