//! Workload shapes and their deterministic expansion into sessions of turns.

use podsim::tokenizer::{words, Rng};
use serde::{Deserialize, Serialize};

fn default_concurrency() -> usize {
    10
}
fn default_seed() -> u64 {
    42
}

/// A workload, as written in a scenario file (`kind: multi_turn | shared_prefix`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Workload {
    /// GenAI-Perf multi-turn sessions: each turn resends the whole history plus a new user
    /// message. With a large `session_prefix_tokens` and many turns this is also the "long
    /// histories" shape that overflows pod caches.
    MultiTurn {
        /// Number of sessions.
        sessions: usize,
        /// Turns per session (mean).
        turns_mean: f64,
        /// Turns per session (stddev).
        #[serde(default)]
        turns_stddev: f64,
        /// New user tokens per turn (mean).
        input_tokens_mean: f64,
        /// New user tokens per turn (stddev).
        #[serde(default)]
        input_tokens_stddev: f64,
        /// max_tokens per turn (mean).
        output_tokens_mean: f64,
        /// max_tokens per turn (stddev).
        #[serde(default)]
        output_tokens_stddev: f64,
        /// Sessions in flight at once.
        #[serde(default = "default_concurrency")]
        concurrency: usize,
        /// Tokens of a system prompt shared by all sessions (0 = none).
        #[serde(default)]
        system_prompt_tokens: usize,
        /// Tokens of a per-session document sent in the first turn (0 = none).
        #[serde(default)]
        session_prefix_tokens: usize,
        /// Text seed.
        #[serde(default = "default_seed")]
        seed: u64,
    },
    /// SGLang generated-shared-prefix: groups of single-turn prompts sharing a system prompt.
    SharedPrefix {
        /// Number of groups.
        groups: usize,
        /// Prompts per group.
        prompts_per_group: usize,
        /// Shared system prompt tokens per group.
        prefix_tokens: usize,
        /// Question tokens per prompt.
        question_tokens: usize,
        /// max_tokens per prompt.
        output_tokens: usize,
        /// Requests in flight at once.
        #[serde(default = "default_concurrency")]
        concurrency: usize,
        /// Text seed.
        #[serde(default = "default_seed")]
        seed: u64,
    },
}

/// One turn to send.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnPlan {
    /// New user message.
    pub user: String,
    /// max_tokens.
    pub max_tokens: usize,
}

/// One session (a conversation, or a single prompt of a shared-prefix group).
#[derive(Debug, Clone, PartialEq)]
pub struct SessionPlan {
    /// Session index.
    pub id: usize,
    /// Group whose prompts share a prefix (shared-prefix groups, or all sessions when a
    /// shared system prompt is used); used by the oracle hit rate.
    pub group: Option<usize>,
    /// System message, if any.
    pub system: Option<String>,
    /// Turns in order.
    pub turns: Vec<TurnPlan>,
}

fn sample(rng: &mut Rng, mean: f64, sd: f64, min: usize) -> usize {
    rng.normal(mean, sd).round().max(min as f64) as usize
}

impl Workload {
    /// Sessions (or requests) allowed in flight at once.
    pub fn concurrency(&self) -> usize {
        match self {
            Workload::MultiTurn { concurrency, .. }
            | Workload::SharedPrefix { concurrency, .. } => (*concurrency).max(1),
        }
    }

    /// Expands the workload into sessions; same workload, same sessions.
    pub fn plan(&self) -> Vec<SessionPlan> {
        match self {
            Workload::MultiTurn {
                sessions,
                turns_mean,
                turns_stddev,
                input_tokens_mean,
                input_tokens_stddev,
                output_tokens_mean,
                output_tokens_stddev,
                system_prompt_tokens,
                session_prefix_tokens,
                seed,
                ..
            } => {
                let mut rng = Rng::new(*seed);
                let system =
                    (*system_prompt_tokens > 0).then(|| words(&mut rng, *system_prompt_tokens));
                (0..*sessions)
                    .map(|id| {
                        let n = sample(&mut rng, *turns_mean, *turns_stddev, 1);
                        let turns = (0..n)
                            .map(|t| {
                                let len =
                                    sample(&mut rng, *input_tokens_mean, *input_tokens_stddev, 1);
                                let mut user = words(&mut rng, len);
                                if t == 0 && *session_prefix_tokens > 0 {
                                    user = format!(
                                        "{} {user}",
                                        words(&mut rng, *session_prefix_tokens)
                                    );
                                }
                                let max_tokens =
                                    sample(&mut rng, *output_tokens_mean, *output_tokens_stddev, 1);
                                TurnPlan { user, max_tokens }
                            })
                            .collect();
                        SessionPlan {
                            id,
                            group: system.as_ref().map(|_| 0),
                            system: system.clone(),
                            turns,
                        }
                    })
                    .collect()
            }
            Workload::SharedPrefix {
                groups,
                prompts_per_group,
                prefix_tokens,
                question_tokens,
                output_tokens,
                seed,
                ..
            } => {
                let mut rng = Rng::new(*seed);
                let prefixes: Vec<String> =
                    (0..*groups).map(|_| words(&mut rng, *prefix_tokens)).collect();
                let mut out = Vec::new();
                for (g, prefix) in prefixes.iter().enumerate() {
                    for _ in 0..*prompts_per_group {
                        out.push(SessionPlan {
                            id: 0,
                            group: Some(g),
                            system: Some(prefix.clone()),
                            turns: vec![TurnPlan {
                                user: words(&mut rng, *question_tokens),
                                max_tokens: *output_tokens,
                            }],
                        });
                    }
                }
                // Shuffle (Fisher-Yates) like SGLang's bench_serving, so groups interleave.
                for i in (1..out.len()).rev() {
                    let j = rng.below(i as u64 + 1) as usize;
                    out.swap(i, j);
                }
                for (i, s) in out.iter_mut().enumerate() {
                    s.id = i;
                }
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podsim::tokenizer::tokenize;

    #[test]
    fn multi_turn_plan_is_deterministic_and_sized() {
        let w = Workload::MultiTurn {
            sessions: 60,
            turns_mean: 5.0,
            turns_stddev: 0.0,
            input_tokens_mean: 200.0,
            input_tokens_stddev: 0.0,
            output_tokens_mean: 800.0,
            output_tokens_stddev: 0.0,
            concurrency: 20,
            system_prompt_tokens: 0,
            session_prefix_tokens: 0,
            seed: 1,
        };
        let a = w.plan();
        assert_eq!(a, w.plan());
        assert_eq!(a.len(), 60);
        assert!(a.iter().all(|s| s.turns.len() == 5 && s.system.is_none()));
        assert_eq!(tokenize(&a[3].turns[2].user).len(), 200);
        assert_eq!(a[3].turns[2].max_tokens, 800);
        assert_ne!(a[0].turns[0].user, a[1].turns[0].user);
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let w = Workload::SharedPrefix {
            groups: 4,
            prompts_per_group: 3,
            prefix_tokens: 100,
            question_tokens: 10,
            output_tokens: 5,
            concurrency: 4,
            seed: 3,
        };
        let p = w.plan();
        assert_eq!(p.len(), 12);
        for g in 0..4 {
            let members: Vec<_> = p.iter().filter(|s| s.group == Some(g)).collect();
            assert_eq!(members.len(), 3);
            assert!(members.iter().all(|s| s.system == members[0].system));
            assert_eq!(tokenize(members[0].system.as_deref().unwrap_or("")).len(), 100);
        }
        // shuffled: not simply group-major
        let order: Vec<_> = p.iter().map(|s| s.group).collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_ne!(order, sorted);
    }
}
