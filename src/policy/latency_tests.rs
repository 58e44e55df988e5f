//! `loadAware`'s observed pod speed: what counts as a sample, and the slowness it gives.

use super::*;

const MS: u64 = 1_000_000;

/// One streamed response from `pod`: headers at `t`, first chunk 100 ms later, then `chunks`
/// chunks of 100 bytes `every_ms` apart. Returns the time after its end.
fn stream(s: &mut PodSpeed, id: u32, pod: &str, t: u64, chunks: u64, every_ms: u64) -> u64 {
    stalled_stream(s, id, pod, t, chunks, (every_ms, u64::MAX, every_ms))
}

#[test]
fn a_pod_decoding_at_half_the_rate_is_twice_as_slow() {
    let mut s = PodSpeed::default();
    let t = stream(&mut s, 1, "a", 0, 20, 10);
    let t = stream(&mut s, 2, "b", t, 20, 20);
    let t = stream(&mut s, 3, "c", t, 20, 10);
    let slow = s.slowness(&["a", "b", "c", "d"], t);
    let get = |p: &str| slow.iter().find(|(a, _)| a == p).map(|(_, v)| v.overall);
    assert_eq!(get("a"), Some(1.0));
    assert!((get("b").unwrap() - 2.0).abs() < 1e-9, "{slow:?}");
    assert_eq!(get("c"), Some(1.0));
    assert_eq!(get("d"), Some(1.0), "no sample: not penalised");
}

#[test]
fn the_time_to_the_first_byte_does_not_count_so_hits_do_not_look_fast() {
    // b's responses start sooner (prefix hits) but decode at the same rate: same speed.
    let mut s = PodSpeed::default();
    for (id, pod, first_ms) in [(1, "a", 900), (2, "b", 10)] {
        s.on_response_headers(id, pod.into(), 0);
        s.on_response_body(id, first_ms * MS, 100, false);
        for i in 1..=20 {
            s.on_response_body(id, (first_ms + 10 * i) * MS, 100, i == 20);
        }
    }
    let none = Slowness::NONE;
    assert_eq!(s.slowness(&["a", "b"], 2000 * MS), vec![("a".into(), none), ("b".into(), none)]);
}

#[test]
fn short_one_chunk_and_cut_responses_give_no_opinion() {
    let mut s = PodSpeed::default();
    // A non-streamed answer (one chunk) and a short one: no decode rate.
    s.on_response_headers(1, "a".into(), 0);
    s.on_response_body(1, 50 * MS, 5000, true);
    s.on_response_headers(2, "b".into(), 0);
    s.on_response_body(2, 10 * MS, 100, false);
    s.on_response_body(2, 500 * MS, 200, true);
    // A stream cut before its end.
    s.on_response_headers(3, "b".into(), 0);
    s.on_response_body(3, 10 * MS, 100, false);
    s.on_response_body(3, 900 * MS, 5000, false);
    assert!(s.slowness(&["a", "b"], MS * 1000).is_empty(), "nothing to compare");
    let t = stream(&mut s, 4, "a", 0, 20, 10);
    let t = stream(&mut s, 5, "b", t, 20, 30);
    assert_eq!(s.slowness(&["a", "b"], t).len(), 2, "two pods with samples compare");
    // A body read in a burst (most chunks at the same instant) is no sample either.
    s.on_response_headers(6, "b".into(), t);
    s.on_response_body(6, t + 10 * MS, 100, false);
    for i in 0..20 {
        s.on_response_body(6, t + if i < 19 { 10 } else { 30 } * MS, 100, i == 19);
    }
    let b = s.slowness(&["a", "b"], t + 30 * MS)[1].1;
    assert_eq!(b, Slowness { overall: 3.0, steady: 3.0 }, "unchanged by the burst");
}

#[test]
fn a_slow_pod_left_without_samples_stays_slow_then_decays_back_gradually() {
    // Avoiding the slow pod stops its samples: a quiet spell must not make it look fast again
    // (it would get new sessions, each found slow anew), but a pod that may have recovered gets
    // sessions back in the end.
    let mut s = PodSpeed::default();
    let t = stream(&mut s, 1, "a", 0, 20, 10);
    let t = stream(&mut s, 2, "b", t, 20, 30);
    let b = |s: &PodSpeed, at: u64| s.slowness(&["a", "b"], at)[1].1.overall;
    let s_now = b(&s, t);
    assert!((s_now - 3.0).abs() < 1e-9, "{s_now}");
    assert!((b(&s, t + 29_000 * MS) - 3.0).abs() < 1e-9, "29 s after its last sample: as slow");
    assert!(b(&s, t + 40_000 * MS) > 2.7, "40 s later still far slower than the fastest");
    // FRESH_NS (30 s) plus one half-life (60 s): half the excess.
    let half = b(&s, t + (30_000 + 60_000) * MS);
    assert!((half - 2.0).abs() < 1e-9, "{half}");
    let later = b(&s, t + (30_000 + 300_000) * MS);
    assert!(later > 1.0 && later < 1.1, "{later}");
    // After twelve half-lives it is dropped: nothing left to compare.
    assert!(s.slowness(&["a", "b"], t + (30_000 + 730_000) * MS).is_empty());
    // A new sample after a quiet spell replaces the old average instead of blending into it.
    let t2 = t + 100_000 * MS;
    let t2 = stream(&mut s, 3, "a", t2, 20, 10);
    let t2 = stream(&mut s, 4, "b", t2, 20, 10);
    assert!((b(&s, t2) - 1.0).abs() < 1e-9, "{}", b(&s, t2));
}

#[test]
fn the_average_follows_a_pod_that_recovers() {
    let mut s = PodSpeed::default();
    let mut t = stream(&mut s, 1, "a", 0, 20, 10);
    t = stream(&mut s, 2, "b", t, 20, 30);
    let b = |s: &PodSpeed, t| s.slowness(&["a", "b"], t)[1].1.overall;
    assert!((b(&s, t) - 3.0).abs() < 1e-9);
    for id in 3..20 {
        t = stream(&mut s, id, "b", t, 20, 10);
    }
    assert!(b(&s, t) < 1.05, "back to the fastest pod's rate: {}", b(&s, t));
}

#[test]
fn an_old_fast_sample_is_not_the_yardstick_for_current_ones() {
    // a was fast once, at a quiet time; b and c are timed now, under load, b twice as slow as c.
    let mut s = PodSpeed::default();
    let t = stream(&mut s, 1, "a", 0, 20, 5);
    let t = t + 120_000 * MS;
    let t = stream(&mut s, 2, "b", t, 20, 20);
    let t = stream(&mut s, 3, "c", t, 20, 10);
    let slow = s.slowness(&["a", "b", "c"], t);
    let get = |p: &str| slow.iter().find(|(a, _)| a == p).map(|(_, v)| v.overall);
    assert_eq!(get("a"), Some(1.0));
    assert!((get("b").unwrap_or(0.0) - 2.0).abs() < 1e-9, "{slow:?}");
    assert_eq!(get("c"), Some(1.0), "compared with c, not with a's old rate: {slow:?}");
}

/// One streamed response from `pod` with `chunks` chunks of 100 bytes `every_ms` apart, where every
/// `stall_every`-th gap is `stall_ms` instead (a step that prefilled a long prompt).
fn stalled_stream(
    s: &mut PodSpeed,
    id: u32,
    pod: &str,
    t: u64,
    chunks: u64,
    (every_ms, stall_every, stall_ms): (u64, u64, u64),
) -> u64 {
    s.on_response_headers(id, pod.into(), t);
    let mut now = t + 100 * MS;
    s.on_response_body(id, now, 100, false);
    for i in 0..chunks {
        now += if (i + 1) % stall_every == 0 { stall_ms } else { every_ms } * MS;
        s.on_response_body(id, now, 100, i + 1 == chunks);
    }
    now
}

#[test]
fn prefill_stalls_slow_a_pod_overall_but_not_steadily() {
    // b decodes at a's rate between stalls, one 70 ms stall every 5 chunks: slower overall, not
    // steadily. c is twice as slow at every step: slower both ways. 300 chunks: more gaps than
    // are kept, so the sampled ones spread over the response.
    let mut s = PodSpeed::default();
    let t = stream(&mut s, 1, "a", 0, 300, 10);
    let t = stalled_stream(&mut s, 2, "b", t, 300, (10, 5, 70));
    let t = stream(&mut s, 3, "c", t, 300, 20);
    let slow = s.slowness(&["a", "b", "c"], t);
    let get =
        |p: &str| slow.iter().find(|(a, _)| a == p).map(|(_, v)| *v).unwrap_or(Slowness::NONE);
    assert!((get("b").overall - 2.2).abs() < 1e-6, "{slow:?}");
    assert!((get("b").steady - 1.0).abs() < 1e-6, "{slow:?}");
    assert!((get("c").overall - 2.0).abs() < 1e-6, "{slow:?}");
    assert!((get("c").steady - 2.0).abs() < 1e-6, "{slow:?}");
    assert_eq!(get("a"), Slowness::NONE);
}

#[test]
fn coalesced_chunks_are_timed_per_byte() {
    // The gateway may read two tokens' events as one chunk after twice the gap: the same rate.
    let mut s = PodSpeed::default();
    let t = stream(&mut s, 1, "a", 0, 40, 10);
    s.on_response_headers(2, "b".into(), t);
    let mut now = t + 100 * MS;
    s.on_response_body(2, now, 100, false);
    for i in 0..20 {
        now += 20 * MS;
        s.on_response_body(2, now, 200, i == 19);
    }
    let slow = s.slowness(&["a", "b"], now);
    assert_eq!(slow[1].1, Slowness::NONE, "{slow:?}");
}

#[test]
fn a_short_answer_is_no_sample_even_streamed() {
    // A few events, each after a prefill stall (a pod taking new prompts): its median is a stall.
    let mut s = PodSpeed::default();
    let t = stream(&mut s, 1, "a", 0, 20, 10);
    let t = stalled_stream(&mut s, 2, "b", t, 10, (10, 1, 140));
    assert!(s.slowness(&["a", "b"], t).is_empty(), "only a has a sample");
    // The same stalls all through a long answer: the pod is that slow.
    let t = stalled_stream(&mut s, 3, "b", t, 20, (10, 1, 140));
    let b = s.slowness(&["a", "b"], t)[1].1;
    assert!((b.steady - 14.0).abs() < 1e-6, "{b:?}");
}
