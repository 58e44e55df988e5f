//! `prefix_cache` with `loadAware`: each pod's prefill backlog as this worker knows it, the prompt
//! bytes it sent the pod that the pod has not started answering (no response body byte yet) and
//! that the pod does not hold (past the matched prefix).
//!
//! Why: in-flight counts weigh a request that prefills a 12k-token document like one that decodes
//! a short answer, and the engines' metrics do not tell them apart either (a prefill in progress
//! is a running request; its KV is a few percent of the cache). A new long prompt sent to a pod
//! that is still prefilling another one waits for it: on document QA (`long-context`) that made
//! least-request placement of first turns slower than hashing sessions blindly.

use super::prefix_cache::MAX_BLOCKS;
use crate::host::Host;
use rustc_hash::FxHashMap;
use std::collections::HashMap;

/// A prompt older than this with no answer no longer counts (a stream whose end the plugin never
/// saw).
const FORGET_NS: u64 = 60 * 1_000_000_000;
/// At most this many prompts are tracked (bounded memory per worker); past it the oldest goes.
const MAX_TRACKED: usize = 4096;

/// One prompt sent and not answered yet.
struct Prompt {
    /// Cumulative bytes of its first prefix blocks (at most [`MAX_BLOCKS`], as many as a pick
    /// can find cached): `cum[i]` = bytes of blocks `0..=i`.
    cum: Vec<usize>,
    /// Bytes of all its blocks.
    total: usize,
    sent_ns: u64,
}

/// How one admitted pick placed a request, as the picker reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement<'a> {
    /// The pod.
    pub pod: &'a str,
    /// Prefix blocks the pod already holds (0 on a miss or a diverted hit).
    pub cached_blocks: usize,
}

/// See the module docs.
#[derive(Default)]
pub struct PrefillBacklog {
    prompts: FxHashMap<u32, Prompt>,
    /// The other workers' backlogs (created at first use, with a random id).
    shared: Option<SharedBacklogs>,
}

impl PrefillBacklog {
    /// `stream`'s prompt, cut into blocks of these byte lengths, is about to be routed.
    pub fn on_prompt(
        &mut self,
        stream: u32,
        block_bytes: impl Iterator<Item = usize>,
        now_ns: u64,
    ) {
        if self.prompts.len() >= MAX_TRACKED {
            self.prompts.retain(|_, p| now_ns.saturating_sub(p.sent_ns) < FORGET_NS);
        }
        if self.prompts.len() >= MAX_TRACKED {
            let oldest = self.prompts.iter().min_by_key(|(_, p)| p.sent_ns).map(|(s, _)| *s);
            if let Some(oldest) = oldest {
                self.prompts.remove(&oldest);
            }
        }
        let mut total = 0usize;
        let mut cum = Vec::new();
        for b in block_bytes {
            total = total.saturating_add(b);
            if cum.len() < MAX_BLOCKS {
                cum.push(total);
            }
        }
        self.prompts.insert(stream, Prompt { cum, total, sent_ns: now_ns });
    }

    /// The pod started answering `stream` (its prefill is over), or the stream ended. Whether
    /// `stream` had a prompt waiting (the backlog changed).
    pub fn on_answered(&mut self, stream: u32) -> bool {
        self.prompts.remove(&stream).is_some()
    }

    /// Whether `stream`'s prompt is waiting for its first answer byte.
    pub fn is_waiting(&self, stream: u32) -> bool {
        self.prompts.contains_key(&stream)
    }

    /// How many prompts are tracked.
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.prompts.len()
    }

    /// Each pod's backlog in bytes: the uncached part of every prompt still waiting for its first
    /// answer byte, by the pod `placement` says it went to (prompts not placed yet, or routed
    /// without Redis, are left out).
    pub fn per_pod<'a>(
        &self,
        now_ns: u64,
        placement: impl Fn(u32) -> Option<Placement<'a>>,
    ) -> Vec<(String, u64)> {
        sum_by_pod(self.prompts.iter().filter_map(|(stream, p)| {
            if now_ns.saturating_sub(p.sent_ns) >= FORGET_NS {
                return None;
            }
            let place = placement(*stream)?;
            let cached =
                place.cached_blocks.checked_sub(1).and_then(|i| p.cum.get(i)).copied().unwrap_or(0);
            Some((place.pod.to_string(), p.total.saturating_sub(cached) as u64))
        }))
    }

    /// Each pod's backlog from every worker of this gateway: this worker's own ([`Self::per_pod`])
    /// and what the others published.
    pub fn totals<'a>(
        &mut self,
        host: &mut dyn Host,
        placement: impl Fn(u32) -> Option<Placement<'a>>,
    ) -> Vec<(String, u64)> {
        let own = self.per_pod(host.now_nanos(), placement);
        let others = self.shared(host).others(host);
        sum_by_pod(own.into_iter().chain(others))
    }

    /// Publishes this worker's backlog for the other workers (when it changed).
    pub fn publish<'a>(
        &mut self,
        host: &mut dyn Host,
        placement: impl Fn(u32) -> Option<Placement<'a>>,
    ) {
        let own = self.per_pod(host.now_nanos(), placement);
        self.shared(host).publish(host, own);
    }

    fn shared(&mut self, host: &mut dyn Host) -> &mut SharedBacklogs {
        self.shared.get_or_insert_with(|| SharedBacklogs::new(host))
    }
}

/// Bytes summed per pod.
fn sum_by_pod(items: impl IntoIterator<Item = (String, u64)>) -> Vec<(String, u64)> {
    let mut by_pod: HashMap<String, u64> = HashMap::new();
    for (pod, bytes) in items {
        let sum = by_pod.entry(pod).or_insert(0);
        *sum = sum.saturating_add(bytes);
    }
    by_pod.into_iter().collect()
}

/// The shared-data key listing the worker VMs that publish a backlog, one id per line.
const WORKERS_KEY: &str = "ai-lb/prefill-workers";
/// A worker's published backlog: this prefix and its id.
const BACKLOG_KEY_PREFIX: &str = "ai-lb/prefill/";
/// Tries of a compare-and-swap write of the worker list before giving up until the next publish.
const CAS_TRIES: usize = 5;

/// The other workers' backlogs, through the gateway's shared data (Envoy's process-wide key-value
/// store for the VMs of one plugin).
///
/// Why: each worker thread of a gateway runs its own VM and sees only the prompts it routed; with
/// the usual one worker per core, a worker would know of a small share of the documents each pod
/// is prefilling (on `long-context` two workers already cost most of what the backlog gains). Each
/// worker publishes its per-pod totals whenever they change (`{written ms}` then `{pod} {bytes}`
/// lines, under its own key, so no write ever contends) and adds the others' to its own at each
/// pick. A value not rewritten for [`FORGET_NS`] (a worker gone with its VM, or one whose
/// prompts all went unanswered) counts as empty and its worker is dropped from the list, as its
/// own prompts would be forgotten.
pub struct SharedBacklogs {
    /// This worker's id (random, unique in the process).
    id: String,
    /// What this worker last published (publishing the same again is skipped).
    published: Option<Vec<(String, u64)>>,
}

impl SharedBacklogs {
    /// A worker with a random id.
    pub fn new(host: &mut dyn Host) -> Self {
        SharedBacklogs { id: format!("{:016x}", host.random_u64()), published: None }
    }

    fn key(id: &str) -> String {
        format!("{BACKLOG_KEY_PREFIX}{id}")
    }

    /// Publishes this worker's backlog `own` (pod -> bytes) if it changed, and joins the worker
    /// list when it is not on it.
    pub fn publish(&mut self, host: &mut dyn Host, mut own: Vec<(String, u64)>) {
        own.retain(|(_, bytes)| *bytes > 0);
        own.sort();
        let changed = self.published.as_ref() != Some(&own);
        if changed {
            let mut value = (host.now_nanos() / 1_000_000).to_string();
            for (pod, bytes) in &own {
                value.push('\n');
                value.push_str(pod);
                value.push(' ');
                value.push_str(&bytes.to_string());
            }
            if host.set_shared_data(&Self::key(&self.id), value.as_bytes(), 0).is_err() {
                return;
            }
            self.published = None;
        }
        // Listed every time: another worker's unchecked first write of the list (CAS 0 while it
        // does not exist) can drop this worker from it.
        let listed = self.edit_workers(host, |ids| {
            if ids.contains(&self.id) {
                return false;
            }
            ids.push(self.id.clone());
            true
        });
        // Not listed (the list kept changing under it): the next publish writes and tries again.
        if changed && listed {
            self.published = Some(own);
        }
    }

    /// Every other worker's backlog, pod -> bytes, summed over the workers; drops from the list
    /// the workers whose value is older than [`FORGET_NS`] (or gone).
    pub fn others(&self, host: &mut dyn Host) -> Vec<(String, u64)> {
        let now_ms = host.now_nanos() / 1_000_000;
        let mut published = Vec::new();
        let mut stale = Vec::new();
        for id in Self::workers(host).0 {
            if id == self.id {
                continue;
            }
            let (value, cas) = host.get_shared_data(&Self::key(&id));
            let value = value.unwrap_or_default();
            let text = String::from_utf8_lossy(&value);
            let mut lines = text.lines();
            let written_ms = lines.next().and_then(|l| l.parse::<u64>().ok());
            let fresh = written_ms
                .is_some_and(|w| now_ms.saturating_sub(w).saturating_mul(1_000_000) < FORGET_NS);
            if !fresh {
                stale.push((id, cas));
                continue;
            }
            published.extend(lines.filter_map(|line| {
                let (pod, bytes) = line.rsplit_once(' ')?;
                Some((pod.to_string(), bytes.parse::<u64>().ok()?))
            }));
        }
        // Cleared only if not rewritten since it was read (a worker that came back keeps its
        // value; its next publish lists it again if it is dropped here anyway).
        let cleared: Vec<String> = stale
            .into_iter()
            .filter(|(id, cas)| host.set_shared_data(&Self::key(id), b"", *cas).is_ok())
            .map(|(id, _)| id)
            .collect();
        if !cleared.is_empty() {
            self.edit_workers(host, |ids| {
                let before = ids.len();
                ids.retain(|i| !cleared.contains(i));
                ids.len() != before
            });
        }
        sum_by_pod(published)
    }

    /// The worker list and its CAS.
    fn workers(host: &dyn Host) -> (Vec<String>, u32) {
        let (value, cas) = host.get_shared_data(WORKERS_KEY);
        let ids = String::from_utf8_lossy(&value.unwrap_or_default())
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect();
        (ids, cas)
    }

    /// Applies `edit` to the worker list (it says whether it changed anything) with a
    /// compare-and-swap write, read back and retried until `edit` finds nothing to change: another
    /// worker may write in between, and while the list does not exist yet its CAS is 0, which
    /// Envoy takes as "no check". Whether the list is now as `edit` wants it.
    fn edit_workers(
        &self,
        host: &mut dyn Host,
        mut edit: impl FnMut(&mut Vec<String>) -> bool,
    ) -> bool {
        for _ in 0..CAS_TRIES {
            let (mut ids, cas) = Self::workers(host);
            if !edit(&mut ids) {
                return true;
            }
            // A stale CAS is retried by the loop.
            let _ = host.set_shared_data(WORKERS_KEY, ids.join("\n").as_bytes(), cas);
        }
        false
    }
}

#[cfg(test)]
#[path = "prefill_tests.rs"]
mod tests;
