//! Workload shapes and their deterministic expansion into sessions of turns.
//!
//! Distributions (all drawn from the workload's `seed`, so every policy gets the same load):
//! - turns per session and new user tokens per turn: normal(mean, stddev), rounded, at least 1;
//! - `max_tokens` per turn: normal(mean, stddev), at least 1. The reply itself may be shorter:
//!   the pods decide when the model stops (EOS, see podsim's `eos_mean_tokens`), as real models do;
//! - think time before each later turn of a session: exponential with mean `think_time_ms_mean`
//!   (simulated ms), the shape of AIPerf's `--conversation-turn-delay-mean` with a memoryless user;
//! - open loop (`arrival_rate_per_s`): sessions start at Poisson times (exponential gaps, simulated
//!   seconds) whatever is still in flight; without it, `concurrency` sessions run at once (closed
//!   loop), a thinking session keeping its slot;
//! - system prompts: `system_prompts` distinct ones of `system_prompt_tokens` each, a session
//!   taking prompt k with probability ∝ 1/(k+1)^`system_prompt_zipf` (0 = uniform).

use podsim::tokenizer::{words, Rng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The name of the one tool an agent session's replies call.
pub const TOOL_NAME: &str = "run_command";

fn default_concurrency() -> usize {
    10
}
fn default_seed() -> u64 {
    42
}
fn one() -> usize {
    1
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
        /// Tokens of each system prompt (0 = none).
        #[serde(default)]
        system_prompt_tokens: usize,
        /// Distinct system prompts sessions choose from.
        #[serde(default = "one")]
        system_prompts: usize,
        /// Zipf exponent of the system prompts' popularity (0 = uniform).
        #[serde(default)]
        system_prompt_zipf: f64,
        /// Mean think time before each later turn (simulated ms, exponential; 0 = none).
        #[serde(default)]
        think_time_ms_mean: f64,
        /// Open loop: sessions start as a Poisson process of this rate (per simulated second).
        #[serde(default)]
        arrival_rate_per_s: Option<f64>,
        /// Tokens of a per-session document sent in the first turn (0 = none).
        #[serde(default)]
        session_prefix_tokens: usize,
        /// Agent sessions: each later turn is a tool round. The previous reply calls a tool and
        /// the turn's new input is its result (a `tool` message), not a user message; the think
        /// time is then the tool's run time.
        #[serde(default)]
        tool_rounds: bool,
        /// Tokens of a `tools` list sent with every request (the same for every session; 0 =
        /// none).
        #[serde(default)]
        tools_tokens: usize,
        /// The OpenAI API the requests use (`chat`: `/v1/chat/completions`, `responses`:
        /// `/v1/responses`). The same conversation either way.
        #[serde(default)]
        api: Api,
        /// `api: responses` only: the conversation is kept on the server. Every request has
        /// `store: true`, and each after the first carries `previous_response_id` and only the
        /// items since that response (a tool round: only its `function_call_output`), as a
        /// client of a stateful Responses server sends them.
        #[serde(default)]
        store_responses: bool,
        /// LoRA adapters the sessions' requests name as their `model` (session k: adapter k mod
        /// n; none: the run's model). An engine keeps each adapter's KV cache apart, so sessions
        /// of one system prompt share their cached prefix only within an adapter.
        #[serde(default)]
        adapters: Vec<String>,
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
        /// Open loop: requests start as a Poisson process of this rate (per simulated second).
        #[serde(default)]
        arrival_rate_per_s: Option<f64>,
        /// Text seed.
        #[serde(default = "default_seed")]
        seed: u64,
    },
}

/// The OpenAI API a workload's requests use.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `/v1/chat/completions` with `messages`.
    #[default]
    Chat,
    /// `/v1/responses` (what Codex-style agents send): `instructions`, `input` items, typed
    /// stream events.
    Responses,
}

impl Api {
    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
        }
    }

    /// What ends a complete stream.
    pub fn stream_end(self) -> &'static str {
        match self {
            Api::Chat => "[DONE]",
            Api::Responses => "response.completed",
        }
    }
}

/// One turn to send.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnPlan {
    /// The turn's new input: a user message, or in a tool round the tool's result.
    pub user: String,
    /// max_tokens.
    pub max_tokens: usize,
    /// Think time before sending this turn, simulated ms (0 for a session's first turn).
    pub think_ms: f64,
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
    /// Whether turns after the first are tool rounds (`tool_rounds`).
    pub tool_rounds: bool,
    /// The `tools` list every request carries, if any.
    pub tools: Option<Value>,
    /// The API the requests use.
    pub api: Api,
    /// Responses API: the conversation is kept on the server (`store_responses`).
    pub store_responses: bool,
    /// Open loop: when the session starts, simulated ms after the run begins.
    pub start_ms: Option<f64>,
    /// The `model` its requests name, when not the run's (a LoRA adapter).
    pub model: Option<String>,
}

fn sample(rng: &mut Rng, mean: f64, sd: f64, min: usize) -> usize {
    rng.normal(mean, sd).round().max(min as f64) as usize
}

/// Exponential with mean `mean` (0 when `mean` is not positive).
pub fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    if mean <= 0.0 {
        return 0.0;
    }
    -mean * (1.0 - rng.next_f64()).ln()
}

/// Index in 0..n with probability ∝ 1/(k+1)^s.
pub fn zipf(rng: &mut Rng, n: usize, s: f64) -> usize {
    let weights: Vec<f64> = (0..n.max(1)).map(|k| 1.0 / ((k + 1) as f64).powf(s)).collect();
    let mut x = rng.next_f64() * weights.iter().sum::<f64>();
    for (k, w) in weights.iter().enumerate() {
        if x < *w {
            return k;
        }
        x -= w;
    }
    weights.len() - 1
}

/// Start times (simulated ms) of `n` arrivals of a Poisson process of `rate` per second, from
/// a stream of their own so the sessions' text does not depend on the arrival option.
fn poisson_starts(seed: u64, n: usize, rate: Option<f64>) -> Vec<Option<f64>> {
    let Some(rate) = rate.filter(|r| *r > 0.0) else { return vec![None; n] };
    let mut rng = Rng::new(seed ^ 0xa771_7a15);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let start = t;
            t += exponential(&mut rng, 1000.0 / rate);
            Some(start)
        })
        .collect()
}

impl Workload {
    /// Sessions (or requests) allowed in flight at once.
    pub fn concurrency(&self) -> usize {
        match self {
            Workload::MultiTurn { concurrency, .. }
            | Workload::SharedPrefix { concurrency, .. } => (*concurrency).max(1),
        }
    }

    /// Whether sessions start on a schedule (open loop) rather than as slots free up.
    pub fn open_loop(&self) -> bool {
        match self {
            Workload::MultiTurn { arrival_rate_per_s, .. }
            | Workload::SharedPrefix { arrival_rate_per_s, .. } => {
                arrival_rate_per_s.is_some_and(|r| r > 0.0)
            }
        }
    }

    /// The same multi-turn workload with `n` sessions (a shorter run of the same shape: the
    /// first `n` sessions of the full plan are the same). None for shared_prefix.
    pub fn with_sessions(&self, n: usize) -> Option<Workload> {
        let mut w = self.clone();
        match &mut w {
            Workload::MultiTurn { sessions, .. } => *sessions = n,
            Workload::SharedPrefix { .. } => return None,
        }
        Some(w)
    }

    /// Sessions per simulated second of an open loop (None for a closed loop).
    pub fn arrival_rate(&self) -> Option<f64> {
        match self {
            Workload::MultiTurn { arrival_rate_per_s, .. }
            | Workload::SharedPrefix { arrival_rate_per_s, .. } => *arrival_rate_per_s,
        }
    }

    /// The same workload as an open loop: sessions start as a Poisson process of `rate` per
    /// simulated second (a load sweep's point).
    pub fn with_arrival_rate(&self, rate: f64) -> Workload {
        let mut w = self.clone();
        match &mut w {
            Workload::MultiTurn { arrival_rate_per_s, .. }
            | Workload::SharedPrefix { arrival_rate_per_s, .. } => *arrival_rate_per_s = Some(rate),
        }
        w
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
                system_prompts,
                system_prompt_zipf,
                think_time_ms_mean,
                arrival_rate_per_s,
                session_prefix_tokens,
                tool_rounds,
                tools_tokens,
                api,
                store_responses,
                adapters,
                seed,
                ..
            } => {
                let mut rng = Rng::new(*seed);
                // From a stream of its own, as popularity and think times below.
                let tools = (*tools_tokens > 0).then(|| {
                    let description = words(&mut Rng::new(seed ^ 0x7001), *tools_tokens);
                    let parameters =
                        json!({"type": "object", "properties": {"command": {"type": "string"}}});
                    match api {
                        Api::Chat => json!([{"type": "function", "function": {
                            "name": TOOL_NAME, "description": description, "parameters": parameters,
                        }}]),
                        // The Responses API's function tools are flat.
                        Api::Responses => json!([{
                            "type": "function", "name": TOOL_NAME, "description": description,
                            "parameters": parameters,
                        }]),
                    }
                });
                let systems: Vec<String> = if *system_prompt_tokens > 0 {
                    (0..(*system_prompts).max(1))
                        .map(|_| words(&mut rng, *system_prompt_tokens))
                        .collect()
                } else {
                    Vec::new()
                };
                // Popularity and think times draw from streams of their own, so adding them to a
                // workload leaves its text (and so its token counts) unchanged.
                let mut pick = Rng::new(seed ^ 0x21bf);
                let mut think = Rng::new(seed ^ 0x7a1e_u64);
                let starts = poisson_starts(*seed, *sessions, *arrival_rate_per_s);
                (0..*sessions)
                    .map(|id| {
                        let system = (!systems.is_empty())
                            .then(|| zipf(&mut pick, systems.len(), *system_prompt_zipf));
                        let adapter = (!adapters.is_empty()).then(|| id % adapters.len());
                        // Sessions share a cached prefix within one system prompt and adapter.
                        let group =
                            system.map(|g| g * adapters.len().max(1) + adapter.unwrap_or(0));
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
                                let think_ms = if t == 0 {
                                    0.0
                                } else {
                                    exponential(&mut think, *think_time_ms_mean)
                                };
                                TurnPlan { user, max_tokens, think_ms }
                            })
                            .collect();
                        SessionPlan {
                            id,
                            group,
                            system: system.and_then(|g| systems.get(g).cloned()),
                            turns,
                            tool_rounds: *tool_rounds,
                            tools: tools.clone(),
                            api: *api,
                            store_responses: *store_responses && *api == Api::Responses,
                            start_ms: starts.get(id).copied().flatten(),
                            model: adapter.and_then(|a| adapters.get(a).cloned()),
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
                arrival_rate_per_s,
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
                                think_ms: 0.0,
                            }],
                            tool_rounds: false,
                            tools: None,
                            api: Api::Chat,
                            store_responses: false,
                            start_ms: None,
                            model: None,
                        });
                    }
                }
                // Shuffle (Fisher-Yates) like SGLang's bench_serving, so groups interleave.
                for i in (1..out.len()).rev() {
                    let j = rng.below(i as u64 + 1) as usize;
                    out.swap(i, j);
                }
                let starts = poisson_starts(*seed, out.len(), *arrival_rate_per_s);
                for (i, s) in out.iter_mut().enumerate() {
                    s.id = i;
                    s.start_ms = starts.get(i).copied().flatten();
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

    fn yaml(text: &str) -> Workload {
        serde_yaml::from_str(text).expect("workload yaml")
    }

    #[test]
    fn multi_turn_plan_is_deterministic_and_sized() {
        let w = yaml("{kind: multi_turn, sessions: 60, turns_mean: 5, input_tokens_mean: 200, output_tokens_mean: 800, concurrency: 20, seed: 1}");
        let a = w.plan();
        assert_eq!(a, w.plan());
        assert_eq!(a.len(), 60);
        assert!(a.iter().all(|s| s.turns.len() == 5 && s.system.is_none()));
        assert_eq!(tokenize(&a[3].turns[2].user).len(), 200);
        assert_eq!(a[3].turns[2].max_tokens, 800);
        assert_ne!(a[0].turns[0].user, a[1].turns[0].user);
    }

    #[test]
    fn agent_sessions_carry_one_tools_list_and_leave_the_text_alone() {
        let base = "{kind: multi_turn, sessions: 20, turns_mean: 8, input_tokens_mean: 40, output_tokens_mean: 30, seed: 4";
        let chat = yaml(&format!("{base}}}")).plan();
        let agent = yaml(&format!("{base}, tool_rounds: true, tools_tokens: 300}}")).plan();
        assert!(chat.iter().all(|s| !s.tool_rounds && s.tools.is_none()));
        assert!(agent.iter().all(|s| s.tool_rounds));
        let tools = agent[0].tools.clone().expect("a tools list");
        assert!(agent.iter().all(|s| s.tools.as_ref() == Some(&tools)), "one list for all");
        let description = tools[0]["function"]["description"].as_str().unwrap_or("");
        assert_eq!(tokenize(description).len(), 300);
        assert_eq!(tools[0]["function"]["name"], TOOL_NAME);
        let turns = |p: &[SessionPlan]| p.iter().map(|s| s.turns.clone()).collect::<Vec<_>>();
        assert_eq!(turns(&chat), turns(&agent), "same inputs, sent as tool results");
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let w = yaml("{kind: shared_prefix, groups: 4, prompts_per_group: 3, prefix_tokens: 100, question_tokens: 10, output_tokens: 5, concurrency: 4, seed: 3}");
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

    #[test]
    fn think_times_are_exponential_and_leave_the_text_alone() {
        let base = "{kind: multi_turn, sessions: 200, turns_mean: 6, input_tokens_mean: 20, output_tokens_mean: 30, output_tokens_stddev: 10, seed: 5";
        let plain = yaml(&format!("{base}}}")).plan();
        let thinking = yaml(&format!("{base}, think_time_ms_mean: 3000}}")).plan();
        let text = |p: &[SessionPlan]| -> Vec<(String, usize)> {
            p.iter().flat_map(|s| s.turns.iter().map(|t| (t.user.clone(), t.max_tokens))).collect()
        };
        assert_eq!(text(&plain), text(&thinking), "same sessions, only the pauses differ");
        assert!(plain.iter().flat_map(|s| &s.turns).all(|t| t.think_ms == 0.0));
        assert!(thinking.iter().all(|s| s.turns[0].think_ms == 0.0), "no pause before turn 1");
        let later: Vec<f64> =
            thinking.iter().flat_map(|s| s.turns[1..].iter().map(|t| t.think_ms)).collect();
        let mean = later.iter().sum::<f64>() / later.len() as f64;
        assert!((2700.0..3300.0).contains(&mean), "mean think {mean} over {}", later.len());
        // exponential: about 1 - e^-1 = 63% below the mean
        let below = later.iter().filter(|t| **t < 3000.0).count() as f64 / later.len() as f64;
        assert!((0.58..0.68).contains(&below), "{below}");
        // max_tokens spread as asked
        let outs: Vec<f64> = text(&plain).iter().map(|(_, m)| *m as f64).collect();
        let m = outs.iter().sum::<f64>() / outs.len() as f64;
        let sd = (outs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / outs.len() as f64).sqrt();
        assert!((29.0..31.0).contains(&m) && (9.0..11.0).contains(&sd), "{m} ± {sd}");
    }

    #[test]
    fn open_loop_sessions_start_as_a_poisson_process() {
        let w = yaml("{kind: multi_turn, sessions: 2000, turns_mean: 1, input_tokens_mean: 5, output_tokens_mean: 5, arrival_rate_per_s: 4, seed: 9}");
        assert!(w.open_loop());
        let starts: Vec<f64> = w.plan().iter().map(|s| s.start_ms.expect("scheduled")).collect();
        assert_eq!(starts[0], 0.0);
        assert!(starts.windows(2).all(|p| p[1] >= p[0]), "in order");
        let gap = starts[starts.len() - 1] / (starts.len() - 1) as f64;
        assert!((235.0..265.0).contains(&gap), "mean gap {gap} ms at 4/s");
        let closed = yaml("{kind: shared_prefix, groups: 2, prompts_per_group: 2, prefix_tokens: 20, question_tokens: 5, output_tokens: 5}");
        assert!(!closed.open_loop());
        assert!(closed.plan().iter().all(|s| s.start_ms.is_none()));
        // A sweep point: the same sessions, now on a schedule at the rate asked.
        let swept = closed.with_arrival_rate(2.0);
        assert!(swept.open_loop());
        assert_eq!(swept.plan().len(), closed.plan().len());
        assert_eq!(swept.plan()[1].turns, closed.plan()[1].turns, "same prompts");
        let faster = w.with_arrival_rate(8.0).plan();
        let last = |p: &[crate::SessionPlan]| p.last().and_then(|s| s.start_ms).unwrap_or(0.0);
        let ratio = last(&w.plan()) / last(&faster);
        assert!((1.8..2.2).contains(&ratio), "twice the rate, half the span: {ratio}");
    }

    #[test]
    fn hot_spot_system_prompts_follow_zipf() {
        let w = yaml("{kind: multi_turn, sessions: 3000, turns_mean: 1, input_tokens_mean: 5, output_tokens_mean: 5, system_prompt_tokens: 50, system_prompts: 4, system_prompt_zipf: 1.0, seed: 2}");
        let plan = w.plan();
        let mut counts = [0usize; 4];
        let mut texts: Vec<Option<String>> = vec![None; 4];
        for s in &plan {
            let g = s.group.expect("a group per system prompt");
            counts[g] += 1;
            let sys = s.system.clone().expect("system prompt");
            assert_eq!(tokenize(&sys).len(), 50);
            let seen = texts[g].get_or_insert_with(|| sys.clone());
            assert_eq!(*seen, sys, "a group is one system prompt");
        }
        assert_ne!(texts[0], texts[1]);
        // 1 : 1/2 : 1/3 : 1/4 over H4 = 2.083: 48%, 24%, 16%, 12%
        let share = |k: usize| counts[k] as f64 / 3000.0;
        assert!((0.45..0.51).contains(&share(0)), "{counts:?}");
        assert!((0.21..0.27).contains(&share(1)), "{counts:?}");
        assert!((0.10..0.14).contains(&share(3)), "{counts:?}");
    }

    /// Adapters: each session names one as its model, in turn, and shares its group (the oracle's
    /// shared prefix) only with the sessions of its system prompt and its adapter. The text is the
    /// same as without adapters.
    #[test]
    fn adapter_sessions_share_a_prefix_within_their_adapter_only() {
        let base = "{kind: multi_turn, sessions: 40, turns_mean: 2, input_tokens_mean: 5, output_tokens_mean: 5, system_prompt_tokens: 30, system_prompts: 2, seed: 6";
        let plain = yaml(&format!("{base}}}")).plan();
        let lora = yaml(&format!("{base}, adapters: [sql, chat, code]}}")).plan();
        assert!(plain.iter().all(|s| s.model.is_none()));
        for (p, s) in plain.iter().zip(&lora) {
            assert_eq!((&p.system, &p.turns), (&s.system, &s.turns));
            let adapter = ["sql", "chat", "code"][s.id % 3];
            assert_eq!(s.model.as_deref(), Some(adapter));
            let (g, sg) = (p.group.expect("a system prompt"), s.group.expect("a group"));
            assert_eq!(sg, g * 3 + s.id % 3, "system prompt {g}, adapter {adapter}");
        }
        let groups: std::collections::HashSet<_> = lora.iter().filter_map(|s| s.group).collect();
        assert_eq!(groups.len(), 6, "2 system prompts x 3 adapters");
    }
}
