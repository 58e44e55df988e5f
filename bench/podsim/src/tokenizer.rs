//! Deterministic tokenizer, chat template, synthetic words and a small PRNG.
//!
//! Shared with the load generator so that its oracle hit rate counts tokens exactly as the
//! simulated pods do.

/// FNV-1a 32-bit hash, used as the token id of a text piece (like llm-d-inference-sim's dummy
/// tokenizer): identical text always gives identical ids, without any vocabulary file.
pub fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in bytes {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// FNV-1a 64-bit hash over token ids (seeds the generated reply of a request).
pub fn hash_tokens(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Splits `text` into tokens: each run of alphanumeric characters is one token, each other
/// non-whitespace character is one token, whitespace separates and is dropped.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    tokenize_into(text, &mut out);
    out
}

/// Like [`tokenize`], appending to `out`.
pub fn tokenize_into(text: &str, out: &mut Vec<u32>) {
    let mut start: Option<usize> = None;
    for (i, c) in text.char_indices() {
        if c.is_alphanumeric() {
            if start.is_none() {
                start = Some(i);
            }
            continue;
        }
        if let Some(s) = start.take() {
            out.push(fnv1a32(&text.as_bytes()[s..i]));
        }
        if !c.is_whitespace() {
            out.push(fnv1a32(&text.as_bytes()[i..i + c.len_utf8()]));
        }
    }
    if let Some(s) = start {
        out.push(fnv1a32(&text.as_bytes()[s..]));
    }
}

/// One chat message as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// "system", "user", "assistant", "tool", ...
    pub role: String,
    /// Text content (array content parts are joined by the server before this point).
    pub content: String,
}

/// Tokens of the chat template: optional tools block first, then `<|role|> content` per
/// message, then the generation prompt `<|assistant|>`. No end-of-turn marker is emitted, so
/// the prompt of turn k+1 starts with exactly prompt(k) + reply(k): the cache sees its own
/// generated tokens again, as in SGLang's RadixAttention.
pub fn chat_prompt_tokens(messages: &[Message], tools_json: Option<&str>) -> Vec<u32> {
    let mut out = Vec::new();
    if let Some(t) = tools_json {
        tokenize_into("<|tools|>", &mut out);
        tokenize_into(t, &mut out);
    }
    for m in messages {
        tokenize_into(&format!("<|{}|>", m.role), &mut out);
        tokenize_into(&m.content, &mut out);
    }
    tokenize_into("<|assistant|>", &mut out);
    out
}

/// SplitMix64: small, fast, deterministic PRNG (no external crate needed).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [0, n) (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// Normal(mean, stddev) via Box-Muller.
    pub fn normal(&mut self, mean: f64, stddev: f64) -> f64 {
        if stddev <= 0.0 {
            return mean;
        }
        let u1 = self.next_f64().max(1e-12);
        let u2 = self.next_f64();
        mean + stddev * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

const CONSONANTS: &[u8] = b"bcdfghjklmnprstvwz";
const VOWELS: &[u8] = b"aeiou";

/// A synthetic lowercase word (2 or 3 syllables); always exactly one token.
pub fn word(rng: &mut Rng) -> String {
    let syllables = 2 + rng.below(2) as usize;
    let mut w = String::with_capacity(syllables * 2);
    for _ in 0..syllables {
        w.push(CONSONANTS[rng.below(CONSONANTS.len() as u64) as usize] as char);
        w.push(VOWELS[rng.below(VOWELS.len() as u64) as usize] as char);
    }
    w
}

/// `n` synthetic words separated by single spaces: exactly `n` tokens.
pub fn words(rng: &mut Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(&word(rng));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_text_gives_identical_tokens() {
        let a = tokenize("Hello, world! How are you?");
        let b = tokenize("Hello, world! How are you?");
        assert_eq!(a, b);
        // words and punctuation are separate tokens, whitespace is dropped
        assert_eq!(a.len(), 8);
        assert_eq!(tokenize("Hello ,world"), tokenize("Hello,  world"));
        assert_ne!(tokenize("hello"), tokenize("Hello"));
    }

    #[test]
    fn concatenation_of_words_is_stable() {
        let mut r = Rng::new(7);
        let text = words(&mut r, 50);
        assert_eq!(tokenize(&text).len(), 50);
        let mut joined = tokenize(&text);
        tokenize_into(" more words", &mut joined);
        assert_eq!(joined, tokenize(&format!("{text} more words")));
    }

    #[test]
    fn next_turn_prompt_extends_previous_prompt_and_reply() {
        let t1 = vec![Message { role: "user".into(), content: "first question".into() }];
        let p1 = chat_prompt_tokens(&t1, None);
        let reply = "ba ce di";
        let mut t2 = t1.clone();
        t2.push(Message { role: "assistant".into(), content: reply.into() });
        t2.push(Message { role: "user".into(), content: "second".into() });
        let p2 = chat_prompt_tokens(&t2, None);
        let mut seen = p1.clone();
        seen.extend(tokenize(reply));
        assert!(p2.starts_with(&seen), "turn 2 prompt must start with turn 1 prompt + reply");
        assert!(p2.len() > seen.len());
    }

    #[test]
    fn tools_come_first() {
        let m = vec![Message { role: "user".into(), content: "x".into() }];
        let with = chat_prompt_tokens(&m, Some("{\"name\":\"f\"}"));
        assert_eq!(&with[..5], &tokenize("<|tools|>")[..]);
        assert!(with.len() > chat_prompt_tokens(&m, None).len());
    }

    #[test]
    fn rng_is_deterministic() {
        let mut a = Rng::new(1);
        let mut b = Rng::new(1);
        assert_eq!(words(&mut a, 20), words(&mut b, 20));
        let mut c = Rng::new(2);
        assert_ne!(words(&mut Rng::new(1), 20), words(&mut c, 20));
    }
}
