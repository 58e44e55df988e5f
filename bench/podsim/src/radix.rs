//! Radix-tree KV cache over token ids, page-granular, in the style of SGLang's RadixAttention:
//! longest-prefix match, insertion of prompt + generated tokens when a request finishes,
//! reference counts (locks) so pages of running requests are never evicted, and LRU eviction
//! of unreferenced leaves.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Index of a node in the tree arena.
pub type NodeId = usize;
/// The root node (empty key, never evicted).
pub const ROOT: NodeId = 0;

#[derive(Debug)]
struct Node {
    key: Vec<u32>,
    /// Children keyed by their first page of tokens.
    children: HashMap<Vec<u32>, NodeId>,
    parent: NodeId,
    lock_ref: u32,
    last_access: u64,
}

/// The cache. Capacity is enforced by [`RadixCache::evict`]; callers decide when to evict.
#[derive(Debug)]
pub struct RadixCache {
    page: usize,
    nodes: Vec<Option<Node>>,
    free: Vec<NodeId>,
    total: usize,
    evictable: usize,
    clock: u64,
}

impl RadixCache {
    /// An empty cache with the given page size (tokens per KV block, >= 1).
    pub fn new(page: usize) -> Self {
        let root = Node {
            key: Vec::new(),
            children: HashMap::new(),
            parent: ROOT,
            lock_ref: 1,
            last_access: 0,
        };
        RadixCache {
            page: page.max(1),
            nodes: vec![Some(root)],
            free: Vec::new(),
            total: 0,
            evictable: 0,
            clock: 0,
        }
    }

    /// Page size in tokens.
    pub fn page(&self) -> usize {
        self.page
    }
    /// Tokens held in the tree.
    pub fn total_tokens(&self) -> usize {
        self.total
    }
    /// Tokens in unreferenced nodes (could be evicted now).
    pub fn evictable_tokens(&self) -> usize {
        self.evictable
    }
    /// Tokens in nodes referenced by running requests.
    pub fn locked_tokens(&self) -> usize {
        self.total - self.evictable
    }
    /// Number of nodes, root excluded.
    pub fn node_count(&self) -> usize {
        self.nodes.iter().filter(|n| n.is_some()).count() - 1
    }

    /// Drops everything (a `/flush_cache`); locked nodes included, so only call when idle.
    pub fn clear(&mut self) {
        *self = RadixCache::new(self.page);
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id].as_ref().expect("live node id")
    }
    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id].as_mut().expect("live node id")
    }

    fn alloc(&mut self, n: Node) -> NodeId {
        if let Some(id) = self.free.pop() {
            self.nodes[id] = Some(n);
            id
        } else {
            self.nodes.push(Some(n));
            self.nodes.len() - 1
        }
    }

    fn aligned<'a>(&self, tokens: &'a [u32]) -> &'a [u32] {
        &tokens[..tokens.len() / self.page * self.page]
    }

    /// Length of the common prefix of `a` and `b`, rounded down to whole pages.
    fn common_pages(&self, a: &[u32], b: &[u32]) -> usize {
        let n = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        n / self.page * self.page
    }

    /// Splits `child` after `at` tokens (page-aligned, 0 < at < key len); returns the new upper node.
    fn split(&mut self, child: NodeId, at: usize) -> NodeId {
        let (upper_key, lower_key, parent, lock_ref, last_access) = {
            let c = self.node(child);
            (c.key[..at].to_vec(), c.key[at..].to_vec(), c.parent, c.lock_ref, c.last_access)
        };
        let mut children = HashMap::new();
        children.insert(lower_key[..self.page].to_vec(), child);
        let first = upper_key[..self.page].to_vec();
        let mid = self.alloc(Node { key: upper_key, children, parent, lock_ref, last_access });
        {
            let c = self.node_mut(child);
            c.key = lower_key;
            c.parent = mid;
        }
        self.node_mut(parent).children.insert(first, mid);
        mid
    }

    /// Longest page-aligned cached prefix of `tokens`. Returns (matched tokens, deepest node).
    /// Touches the matched path (LRU) and splits a node where the match ends inside it, so
    /// the returned node covers exactly the matched prefix and can be locked.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> (usize, NodeId) {
        self.clock += 1;
        let clock = self.clock;
        let tokens = self.aligned(tokens);
        let mut node = ROOT;
        let mut pos = 0;
        while pos < tokens.len() {
            let first = &tokens[pos..pos + self.page];
            let Some(&child) = self.node(node).children.get(first) else { break };
            let l = self.common_pages(&self.node(child).key, &tokens[pos..]);
            self.node_mut(child).last_access = clock;
            if l < self.node(child).key.len() {
                node = self.split(child, l);
                pos += l;
                break;
            }
            node = child;
            pos += l;
        }
        (pos, node)
    }

    /// Inserts the page-aligned part of `tokens`; returns how many of those tokens were
    /// already cached. New nodes are unreferenced (evictable).
    pub fn insert(&mut self, tokens: &[u32]) -> usize {
        let (matched, node) = self.match_prefix(tokens);
        let tokens = self.aligned(tokens);
        if matched < tokens.len() {
            let rest = tokens[matched..].to_vec();
            let first = rest[..self.page].to_vec();
            let len = rest.len();
            let leaf = self.alloc(Node {
                key: rest,
                children: HashMap::new(),
                parent: node,
                lock_ref: 0,
                last_access: self.clock,
            });
            self.node_mut(node).children.insert(first, leaf);
            self.total += len;
            self.evictable += len;
        }
        matched
    }

    /// Adds a reference to `node` and all its ancestors (a running request uses that prefix).
    pub fn lock(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = self.nodes[node].as_mut().expect("live node id");
            if n.lock_ref == 0 {
                self.evictable -= n.key.len();
            }
            n.lock_ref += 1;
            node = n.parent;
        }
    }

    /// Removes a reference added by [`RadixCache::lock`].
    pub fn unlock(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = self.nodes[node].as_mut().expect("live node id");
            n.lock_ref = n.lock_ref.saturating_sub(1);
            if n.lock_ref == 0 {
                self.evictable += n.key.len();
            }
            node = n.parent;
        }
    }

    /// Evicts unreferenced leaves, least recently used first, until at least `tokens` tokens
    /// are freed or nothing evictable is left. Returns the number of tokens freed.
    pub fn evict(&mut self, tokens: usize) -> usize {
        if tokens == 0 {
            return 0;
        }
        let mut heap: BinaryHeap<Reverse<(u64, NodeId)>> = BinaryHeap::new();
        for (id, n) in self.nodes.iter().enumerate() {
            if let Some(n) = n {
                if id != ROOT && n.children.is_empty() && n.lock_ref == 0 {
                    heap.push(Reverse((n.last_access, id)));
                }
            }
        }
        let mut freed = 0;
        while freed < tokens {
            let Some(Reverse((_, id))) = heap.pop() else { break };
            let Some(n) = self.nodes[id].take() else { continue };
            self.free.push(id);
            let len = n.key.len();
            freed += len;
            self.total -= len;
            self.evictable -= len;
            let parent = n.parent;
            let page = self.page;
            let p = self.node_mut(parent);
            p.children.remove(&n.key[..page]);
            if parent != ROOT && p.children.is_empty() && p.lock_ref == 0 {
                heap.push(Reverse((p.last_access, parent)));
            }
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(start: u32, n: usize) -> Vec<u32> {
        (start..start + n as u32).collect()
    }

    #[test]
    fn match_on_empty_and_after_insert() {
        let mut c = RadixCache::new(4);
        assert_eq!(c.match_prefix(&seq(0, 10)).0, 0);
        assert_eq!(c.insert(&seq(0, 10)), 0);
        // only whole pages are cached: 10 tokens -> 8
        assert_eq!(c.total_tokens(), 8);
        assert_eq!(c.match_prefix(&seq(0, 10)).0, 8);
        assert_eq!(c.match_prefix(&seq(0, 7)).0, 4);
        let mut other = seq(0, 12);
        other[5] = 999; // diverges inside page 2
        assert_eq!(c.match_prefix(&other).0, 4);
        assert_eq!(c.match_prefix(&seq(100, 8)).0, 0);
    }

    #[test]
    fn insert_reports_existing_prefix_and_splits() {
        let mut c = RadixCache::new(2);
        c.insert(&seq(0, 8));
        assert_eq!(c.node_count(), 1);
        let mut b = seq(0, 8);
        b[4] = 50;
        b[5] = 51;
        b[6] = 52;
        b[7] = 53;
        assert_eq!(c.insert(&b), 4, "first two pages are shared");
        // [0..4] split off as a parent of the old tail [4..8] and the new tail
        assert_eq!(c.node_count(), 3);
        assert_eq!(c.total_tokens(), 12);
        assert_eq!(c.match_prefix(&seq(0, 8)).0, 8);
        assert_eq!(c.match_prefix(&b).0, 8);
        // inserting a prefix of an existing path adds nothing
        assert_eq!(c.insert(&seq(0, 6)), 6);
        assert_eq!(c.total_tokens(), 12);
    }

    #[test]
    fn evicts_least_recently_used_leaf_first() {
        let mut c = RadixCache::new(4);
        let a = seq(0, 8);
        let b = seq(100, 8);
        let d = seq(200, 8);
        c.insert(&a);
        c.insert(&b);
        c.insert(&d);
        c.match_prefix(&a); // a is now more recent than b
        assert_eq!(c.evict(8), 8);
        assert_eq!(c.match_prefix(&b).0, 0, "b was least recently used");
        assert_eq!(c.match_prefix(&a).0, 8);
        assert_eq!(c.match_prefix(&d).0, 8);
        // next: a was touched before d in the last two matches, so a goes first
        c.evict(1);
        assert_eq!(c.match_prefix(&a).0, 0);
        assert_eq!(c.match_prefix(&d).0, 8);
    }

    #[test]
    fn eviction_walks_up_to_parents_leaf_first() {
        let mut c = RadixCache::new(2);
        c.insert(&seq(0, 8));
        let mut b = seq(0, 8);
        b[6] = 70;
        b[7] = 71;
        c.insert(&b);
        assert_eq!(c.total_tokens(), 10);
        // freeing 3 tokens removes two 2-token leaves, keeping the shared 6-token parent
        assert_eq!(c.evict(3), 4);
        assert_eq!(c.match_prefix(&seq(0, 8)).0, 6);
        assert_eq!(c.evict(100), 6);
        assert_eq!(c.total_tokens(), 0);
        assert_eq!(c.node_count(), 0);
    }

    #[test]
    fn locked_prefix_is_never_evicted() {
        let mut c = RadixCache::new(4);
        let a = seq(0, 16);
        c.insert(&a);
        c.insert(&seq(100, 16));
        let (m, node) = c.match_prefix(&seq(0, 8)); // splits a after 8 tokens
        assert_eq!(m, 8);
        c.lock(node);
        assert_eq!(c.locked_tokens(), 8);
        assert_eq!(c.evict(1000), 24, "everything but the locked 8 tokens goes");
        assert_eq!(c.match_prefix(&a).0, 8);
        c.unlock(node);
        assert_eq!(c.evictable_tokens(), 8);
        assert_eq!(c.evict(1000), 8);
        assert_eq!(c.total_tokens(), 0);
    }

    #[test]
    fn lock_survives_a_later_split() {
        let mut c = RadixCache::new(4);
        c.insert(&seq(0, 16));
        let (_, node) = c.match_prefix(&seq(0, 16));
        c.lock(node);
        // a new branch splits the locked node; the upper half must stay locked too
        let mut b = seq(0, 16);
        b[9] = 999;
        c.insert(&b);
        assert_eq!(c.locked_tokens(), 16);
        c.evict(1000);
        assert_eq!(c.match_prefix(&seq(0, 16)).0, 16);
        c.unlock(node);
        assert_eq!(c.locked_tokens(), 0);
    }
}
