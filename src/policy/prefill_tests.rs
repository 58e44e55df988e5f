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
    b.on_answered(1);
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
