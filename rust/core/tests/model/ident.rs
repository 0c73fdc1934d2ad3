//! The identity of a published prefix, as the model states it: everything a unit digest covers
//! and nothing else. A prefix of `p` tokens (p a multiple of U) is the same key for two
//! sequences exactly when they agree on the tokens of `[0, p)`, the cache salt, the `LoRA` id,
//! and, for every unit `j < p / U`, on the ordered list of the hashes of the multimodal inputs
//! whose token range overlaps `[jU, (j+1)U)` (an input's range itself is not part of it).
//!
//! Identities are interned: a prefix is its length and a small id, equal ids meaning equal
//! identities, so that a sequence's keys are computed once per `add` or `append` and compared
//! in O(1). The interning is a table lookup on the whole unit content, never a hash of it.
//! Each identity also remembers its root (salt and `LoRA` id) and the id of its tokens alone, so
//! a test can tell what stopped a hit: another sequence's image, or its salt or adapter.

use std::collections::HashMap;

use prefixcache_core::ExtraKeys;

/// A prefix identity: its length in tokens and its interned id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub(crate) struct Prefix {
    pub(crate) len: u32,
    id: u32,
}

#[derive(Clone, Debug)]
struct Node {
    /// The identity one unit shorter (0: the root).
    parent: u32,
    /// The root: which salt and adapter.
    root: u32,
    /// The same tokens with no extra keys at all.
    plain: u32,
}

/// A unit's content: the identity before it, its tokens, the hashes of the inputs on it.
type UnitContent = (u32, Vec<u32>, Vec<Vec<u8>>);

/// The intern tables.
#[derive(Clone, Debug, Default)]
pub(crate) struct Idents {
    roots: HashMap<(Option<Vec<u8>>, Option<u64>), u32>,
    /// (parent, unit tokens, hashes of the inputs overlapping the unit) -> id.
    units: HashMap<UnitContent, u32>,
    /// Plain token chains: (parent, unit tokens) -> id.
    plain: HashMap<(u32, Vec<u32>), u32>,
    /// Node of id `i` at index `i - 1`.
    nodes: Vec<Node>,
    next_plain: u32,
}

impl Idents {
    fn root(&mut self, extra: &ExtraKeys) -> u32 {
        let key = (extra.cache_salt.clone(), extra.lora_id);
        let next = self.roots.len() as u32 + 1;
        *self.roots.entry(key).or_insert(next)
    }

    /// The identity of every full unit's prefix of a sequence: `keys[i]` is the prefix of
    /// `(i + 1) * unit` tokens.
    pub(crate) fn keys(&mut self, unit: u32, tokens: &[u32], extra: &ExtraKeys) -> Vec<Prefix> {
        let root = self.root(extra);
        let unit = unit as usize;
        let (mut parent, mut plain_parent) = (0u32, 0u32);
        let mut out = Vec::with_capacity(tokens.len() / unit);
        for (j, chunk) in tokens.chunks_exact(unit).enumerate() {
            let (from, to) = ((j * unit) as u64, ((j + 1) * unit) as u64);
            let images: Vec<Vec<u8>> = extra
                .multimodal
                .iter()
                .filter(|m| u64::from(m.start) < to && u64::from(m.end) > from)
                .map(|m| m.hash.clone())
                .collect();
            let plain_key = (plain_parent, chunk.to_vec());
            let next_plain = self.next_plain + 1;
            let plain = *self.plain.entry(plain_key).or_insert(next_plain);
            if plain == next_plain {
                self.next_plain = next_plain;
            }
            // The root enters through the first unit's parent: a salt or adapter changes
            // every key from unit 0 on, as the digest chain does.
            let parent_key = if j == 0 { u32::MAX - root } else { parent };
            let next = self.nodes.len() as u32 + 1;
            let id = *self.units.entry((parent_key, chunk.to_vec(), images)).or_insert(next);
            if id == next {
                self.nodes.push(Node { parent, root, plain });
            }
            out.push(Prefix { len: ((j + 1) * unit) as u32, id });
            (parent, plain_parent) = (id, plain);
        }
        out
    }

    fn node(&self, p: Prefix) -> &Node {
        &self.nodes[p.id as usize - 1]
    }

    /// Whether `a` is a prefix of `b` (or equal to it).
    pub(crate) fn is_prefix(&self, a: Prefix, b: Prefix, unit: u32) -> bool {
        let mut b = b;
        while b.len > a.len {
            let parent = self.node(b).parent;
            if parent == 0 {
                return false;
            }
            b = Prefix { len: b.len - unit, id: parent };
        }
        a == b
    }

    /// Same tokens and same salt and adapter, but not the same key: multimodal inputs differ.
    pub(crate) fn differs_by_images(&self, a: Prefix, b: Prefix) -> bool {
        let (na, nb) = (self.node(a), self.node(b));
        a != b && na.plain == nb.plain && na.root == nb.root
    }

    /// Same tokens, another salt or adapter.
    pub(crate) fn differs_by_root(&self, a: Prefix, b: Prefix) -> bool {
        let (na, nb) = (self.node(a), self.node(b));
        na.plain == nb.plain && na.root != nb.root
    }
}
