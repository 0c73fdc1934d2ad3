//! Extra keys of the random traffic: cache salts, `LoRA` ids and multimodal inputs over random
//! token ranges, either fresh or taken from the sequence a prompt is copied from and then
//! changed a little (an image dropped, added, moved or replaced, the salt or adapter changed),
//! so that twins and `extends` between sequences with different images are common. Some lists
//! are deliberately out of order or malformed.
//!
//! The rules are stated here independently of the crate: which lists `add` must accept
//! (`refusal`), and how many units of digests `add` may take from another sequence
//! (`reusable_units`: reuse stops at the earliest unit any differing extra key touches).

use prefixcache_core::limits::{MAX_EXTRA_KEY_BYTES, MAX_MULTIMODAL_INPUTS};
use prefixcache_core::{ExtraKeys, MultimodalInput};
use proptest::prelude::*;

/// Image contents: few, so that the same image shows up in several prompts.
const HASHES: [&[u8]; 3] = [b"image-a", b"image-b", b"image-c"];
/// Salts: two tenants and the empty salt (an entry of its own, distinct from none).
const SALTS: [&[u8]; 3] = [b"tenant-1", b"tenant-2", b""];
/// Adapters, the largest id included.
const LORAS: [u64; 3] = [1, 7, u64::MAX];

/// How a deliberately bad list is bad.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Fault {
    /// Two inputs listed in the wrong order of (start, end).
    Unsorted,
    /// An input with `start == end`.
    Empty,
    /// An input with `start > end`.
    Inverted,
    /// An input ending beyond the prompt (`u32::MAX` included).
    BeyondEnd,
    /// An input with an empty hash.
    EmptyHash,
    /// A salt one byte over `MAX_EXTRA_KEY_BYTES`.
    LongSalt,
    /// An input whose hash is one byte over `MAX_EXTRA_KEY_BYTES`.
    LongHash,
    /// One input more than `MAX_MULTIMODAL_INPUTS`.
    TooManyInputs,
}

/// What an `Add` does with extra keys.
#[derive(Clone, Debug)]
pub(crate) struct ExtraOp {
    /// Start from the extra keys of the sequence the prompt is copied from (if any).
    pub inherit: bool,
    /// 0 none, else an index into the salts.
    pub salt: u8,
    /// 0 none, else an index into the adapters.
    pub lora: u8,
    /// Fresh inputs: (start, length, content), resolved against the prompt's length.
    pub images: Vec<(u8, u8, u8)>,
    /// For inherited keys: 0 keep, 1 drop the first input, 2 drop the last, 3 replace one
    /// input's content, 4 add an input, 5 change the salt, 6 change the adapter, 7 move an
    /// input's start.
    pub tweak: u8,
    pub fault: Option<Fault>,
}

impl ExtraOp {
    pub(crate) fn none() -> Self {
        Self { inherit: false, salt: 0, lora: 0, images: Vec::new(), tweak: 0, fault: None }
    }
}

pub(crate) fn extra_op() -> impl Strategy<Value = ExtraOp> {
    let fault = prop_oneof![
        Just(Fault::Unsorted),
        Just(Fault::Empty),
        Just(Fault::Inverted),
        Just(Fault::BeyondEnd),
        Just(Fault::EmptyHash),
        Just(Fault::LongSalt),
        Just(Fault::LongHash),
        Just(Fault::TooManyInputs),
    ];
    (
        prop::bool::weighted(0.6),
        prop_oneof![3 => Just(0u8), 1 => 1u8..=3],
        prop_oneof![3 => Just(0u8), 1 => 1u8..=3],
        prop::collection::vec((any::<u8>(), 1u8..=8, 0u8..3), 0..=3),
        prop_oneof![3 => Just(0u8), 2 => 1u8..=7],
        prop::option::weighted(0.08, fault),
    )
        .prop_map(|(inherit, salt, lora, images, tweak, fault)| ExtraOp {
            inherit,
            salt,
            lora,
            images,
            tweak,
            fault,
        })
}

fn salt(i: u8) -> Option<Vec<u8>> {
    (i > 0).then(|| SALTS[usize::from(i - 1) % SALTS.len()].to_vec())
}

fn lora(i: u8) -> Option<u64> {
    (i > 0).then(|| LORAS[usize::from(i - 1) % LORAS.len()])
}

fn image(start: u32, end: u32, content: u8) -> MultimodalInput {
    MultimodalInput { start, end, hash: HASHES[usize::from(content) % HASHES.len()].to_vec() }
}

/// Sorts by (start, end), as `add` requires; the sort is stable, so inputs of one range keep
/// their order (which the digest sees).
pub(crate) fn sort_inputs(inputs: &mut [MultimodalInput]) {
    inputs.sort_by_key(|m| (m.start, m.end));
}

/// The extra keys of a prompt of `len` tokens. `base` are the keys of the sequence the prompt
/// was copied from; inputs that do not fit the new prompt are dropped.
pub(crate) fn resolve(op: &ExtraOp, len: u32, base: Option<&ExtraKeys>) -> ExtraKeys {
    let mut keys = match base.filter(|_| op.inherit) {
        Some(base) => {
            let mut keys = base.clone();
            keys.multimodal.retain(|m| m.end <= len);
            let n = keys.multimodal.len();
            let pick = usize::from(op.images.first().map_or(0, |i| i.0));
            match op.tweak {
                1 if n > 0 => drop(keys.multimodal.remove(0)),
                2 if n > 0 => drop(keys.multimodal.pop()),
                3 if n > 0 => {
                    let m = &mut keys.multimodal[pick % n];
                    let next = HASHES.iter().position(|h| *h == m.hash).map_or(0, |i| i + 1);
                    m.hash = HASHES[next % HASHES.len()].to_vec();
                }
                5 => {
                    let next = salt(op.salt % 4);
                    keys.cache_salt =
                        if next == keys.cache_salt { salt((op.salt + 1) % 4) } else { next };
                }
                6 => {
                    let next = lora(op.lora % 4);
                    keys.lora_id =
                        if next == keys.lora_id { lora((op.lora + 1) % 4) } else { next };
                }
                7 if n > 0 => {
                    let m = &mut keys.multimodal[pick % n];
                    if m.start + 1 < m.end {
                        m.start += 1;
                    } else if m.start > 0 {
                        m.start -= 1;
                    }
                }
                1..=7 => {
                    let (s, l, c) = op.images.first().copied().unwrap_or((0, 2, 1));
                    let start = u32::from(s) % len;
                    keys.multimodal.push(image(start, (start + u32::from(l)).min(len), c));
                }
                _ => {}
            }
            keys
        }
        None => ExtraKeys {
            cache_salt: salt(op.salt),
            lora_id: lora(op.lora),
            multimodal: op
                .images
                .iter()
                .map(|&(s, l, c)| {
                    // Mostly near the start of the prompt, where hits are.
                    let start = u32::from(s) % len.min(if s % 2 == 0 { 24 } else { len });
                    image(start, (start + u32::from(l)).min(len), c)
                })
                .collect(),
        },
    };
    sort_inputs(&mut keys.multimodal);
    match op.fault {
        None => {}
        Some(Fault::Unsorted) => {
            if keys.multimodal.is_empty() {
                keys.multimodal.push(image(len - 1, len, 0));
            }
            let first = &keys.multimodal[0];
            if (first.start, first.end) > (0, 1) {
                // An earlier input listed last.
                keys.multimodal.push(image(0, 1, 1));
            } else if len >= 2 {
                // A later input listed first.
                keys.multimodal.insert(0, image(0, 2, 1));
            }
        }
        Some(Fault::Empty) => keys.multimodal.push(image(len / 2, len / 2, 0)),
        Some(Fault::Inverted) => keys.multimodal.push(image(len, len / 2, 0)),
        Some(Fault::BeyondEnd) => {
            let end = if len % 2 == 0 { u32::MAX } else { len + 1 };
            keys.multimodal.push(image(len - 1, end, 2));
        }
        Some(Fault::EmptyHash) => {
            let mut m = image(0, 1, 0);
            m.hash.clear();
            keys.multimodal.insert(0, m);
        }
        Some(Fault::LongSalt) => keys.cache_salt = Some(vec![7; MAX_EXTRA_KEY_BYTES + 1]),
        Some(Fault::LongHash) => {
            let mut m = image(0, 1, 0);
            m.hash = vec![9; MAX_EXTRA_KEY_BYTES + 1];
            keys.multimodal.insert(0, m);
        }
        Some(Fault::TooManyInputs) => {
            keys.multimodal = vec![image(0, 1, 0); MAX_MULTIMODAL_INPUTS + 1];
        }
    }
    keys
}

/// Why `add` must refuse these extra keys for a prompt of `len` tokens, if it must: every
/// input needs `start < end <= len` and a non-empty hash of at most `MAX_EXTRA_KEY_BYTES`
/// bytes (the salt too), there are at most `MAX_MULTIMODAL_INPUTS` of them, and the list must
/// be in order of (start, end).
pub(crate) fn refusal(keys: &ExtraKeys, len: u32) -> Option<&'static str> {
    let inputs = &keys.multimodal;
    let too_long = |b: &[u8]| b.len() > MAX_EXTRA_KEY_BYTES;
    if inputs.len() > MAX_MULTIMODAL_INPUTS
        || keys.cache_salt.as_deref().is_some_and(too_long)
        || inputs.iter().any(|m| too_long(&m.hash))
    {
        return Some("beyond a bound");
    }
    if inputs.iter().any(|m| m.start >= m.end || m.end > len || m.hash.is_empty()) {
        return Some("malformed");
    }
    let in_order = inputs.windows(2).all(|w| (w[0].start, w[0].end) <= (w[1].start, w[1].end));
    (!in_order).then_some("unsorted")
}

/// How many units of digests a prompt (`tokens`, `keys`) may take from another sequence
/// (`other_tokens`, `other_keys`): the units of their common token prefix, but none when salt
/// or adapter differ, and none from the unit holding the earliest start of any input that
/// differs (both lists are in order, so: the inputs from the first list position where the two
/// disagree on).
pub(crate) fn reusable_units(
    unit: u32,
    (tokens, keys): (&[u32], &ExtraKeys),
    (other_tokens, other_keys): (&[u32], &ExtraKeys),
) -> usize {
    if keys.cache_salt != other_keys.cache_salt || keys.lora_id != other_keys.lora_id {
        return 0;
    }
    let common = tokens.iter().zip(other_tokens).take_while(|(a, b)| a == b).count();
    let (a, b) = (&keys.multimodal, &other_keys.multimodal);
    let agree = (0..a.len().max(b.len())).take_while(|&i| a.get(i) == b.get(i)).count();
    let earliest = a[agree..].iter().chain(&b[agree..]).map(|m| m.start as usize).min();
    common.min(earliest.unwrap_or(usize::MAX)) / unit as usize
}
