//! Block events for external indexers (KV-aware routers): what became reachable, what stopped
//! being reachable, with monotone sequence numbers, drained by the caller, in process or
//! encoded for the wire in vLLM 0.33's KV-event format.
//!
//! Recording rules (the store calls [`EventLog::stored_key`] and [`EventLog::removed`]):
//! - a `BlockStored` is one *run*: consecutive unit keys of one group whose chain continues the
//!   previous key (a commit that publishes a sequence's keys across several blocks emits one
//!   event, with the block carrying each key); a checkpoint is an event of its own;
//! - the run carries the token ids it covers, from the start of the first wire block it
//!   completes (the wire block W is the hash unit U by default, or a paged group's block size),
//!   so an encoder can give every wire block exactly its tokens;
//! - a `BlockRemoved` lists every key the evicted block lost, and apart the keys at wire-block
//!   boundaries that no block of the group carries any more: only those leave a router's view
//!   (a duplicate copy evicted while another still serves the key changes nothing a router can
//!   route on).
//!
//! Vectors of drained events are kept for reuse, so recording allocates nothing once warm
//! when the caller drains through [`EventLog::drain_wire`].

use std::collections::VecDeque;

use crate::hashing::{Digest, ExtraKeys, MultimodalInput};
use crate::pool::{BlockId, BlockKey};

/// One change of what the cache can serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A run of keys published at a commit (or a decode-tail checkpoint at `finish`).
    BlockStored {
        group: u32,
        /// The block carrying the first key.
        block: BlockId,
        /// The block carrying each key (a run may span several blocks of the group).
        blocks: Vec<BlockId>,
        /// The keys added, in position order: `keys[i]` fingerprints the prefix of
        /// `token_start + (i + 1) * U` tokens.
        keys: Vec<Digest>,
        /// The key just before the first added one (`None` at the start of the sequence).
        parent: Option<Digest>,
        /// Tokens `[token_start, token_end)` the added keys cover.
        token_start: u32,
        token_end: u32,
        /// Whether the block is a recurrent-state checkpoint.
        checkpoint: bool,
        /// The token ids `[tokens_start, token_end)`: the run's own, preceded by those of the
        /// wire block its first key falls in (`tokens_start == token_start` when W = U).
        tokens: Vec<u32>,
        tokens_start: u32,
        /// The key at `tokens_start` (`None` at 0): the parent of the first wire block.
        wire_parent: Option<Digest>,
        /// The sequence's adapter id.
        lora_id: Option<u64>,
        /// The sequence's cache salt, when the run starts at token 0 (the salt is part of the
        /// first unit's key only).
        cache_salt: Option<Vec<u8>>,
        /// The sequence's multimodal inputs that overlap `[tokens_start, token_end)`, in order
        /// (on the wire, each block's `extra_keys` name those overlapping it).
        multimodal: Vec<MultimodalInput>,
    },
    /// A block lost every key (evicted for reuse).
    BlockRemoved {
        group: u32,
        block: BlockId,
        /// Every key the block carried.
        keys: Vec<Digest>,
        /// Those of `keys` at wire-block boundaries that no block of the group carries now.
        gone: Vec<Digest>,
    },
    /// `reset` dropped everything.
    AllBlocksCleared,
}

/// An event with its sequence number (strictly increasing, never reused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRecord {
    pub sequence: u64,
    pub event: CacheEvent,
}

/// How a group's blocks are named on the wire (vLLM's `kv_cache_spec_kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireKind {
    FullAttention,
    SlidingWindow(u32),
    /// Recurrent-state checkpoints.
    Mamba,
}

impl WireKind {
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::FullAttention => "full_attention",
            Self::SlidingWindow(_) => "sliding_window",
            Self::Mamba => "mamba",
        }
    }
}

/// What the wire encoding needs to know about the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireFormat {
    /// The wire's block size W (a multiple of U).
    pub block_size: u32,
    /// The hash unit U.
    pub unit: u32,
    /// Meaningful bytes of a digest (16 for `xxh3_128`, 32 for `sha256`).
    pub digest_len: usize,
    /// Per group, its kind.
    pub kinds: Vec<WireKind>,
}

impl WireFormat {
    /// The wire id of a digest: the low 64 bits of its meaningful bytes read big-endian (what
    /// vLLM sends), or, when those are 0 (which routers read as "no parent"), the 64 bits above
    /// them, or 1.
    #[must_use]
    pub fn id(&self, digest: &Digest) -> u64 {
        let bytes = &digest.0[..self.digest_len];
        let word = |end: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[end - 8..end]);
            u64::from_be_bytes(w)
        };
        let low = word(bytes.len());
        if low != 0 {
            return low;
        }
        match word(bytes.len() - 8) {
            0 => 1,
            high => high,
        }
    }
}

/// A bounded queue of events.
#[derive(Clone, Debug)]
pub struct EventLog {
    enabled: bool,
    capacity: usize,
    next_sequence: u64,
    dropped: u64,
    pending: VecDeque<EventRecord>,
    format: WireFormat,
    /// Whether the last pending event is a run the next key may extend (until `seal`).
    open: bool,
    spare_digests: Vec<Vec<Digest>>,
    spare_blocks: Vec<Vec<BlockId>>,
    spare_tokens: Vec<Vec<u32>>,
}

impl EventLog {
    #[must_use]
    pub fn new(enabled: bool, capacity: usize, format: WireFormat) -> Self {
        Self {
            enabled,
            capacity,
            next_sequence: 0,
            dropped: 0,
            pending: VecDeque::new(),
            format,
            open: false,
            spare_digests: Vec::new(),
            spare_blocks: Vec::new(),
            spare_tokens: Vec::new(),
        }
    }

    #[must_use]
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The wire format events are encoded in.
    #[must_use]
    pub fn format(&self) -> &WireFormat {
        &self.format
    }

    pub fn push(&mut self, event: CacheEvent) {
        if !self.enabled {
            return;
        }
        self.open = false;
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        if self.pending.len() >= self.capacity.max(1) {
            if let Some(old) = self.pending.pop_front() {
                self.recycle(old.event);
            }
            self.dropped += 1;
        }
        self.pending.push_back(EventRecord { sequence, event });
    }

    /// Records that `block` of `group` now carries the key at unit boundary `position` of the
    /// sequence whose tokens, unit digests and extra keys are given: extends the last pending
    /// event when it is a run of the same group that this key continues, else starts one.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn stored_key(
        &mut self,
        group: u32,
        block: BlockId,
        position: u32,
        checkpoint: bool,
        tokens: &[u32],
        hashes: &[Digest],
        extra: &ExtraKeys,
    ) {
        if !self.enabled {
            return;
        }
        let unit = self.format.unit;
        let digest = hashes[(position / unit - 1) as usize];
        let token_start = position - unit;
        let digest_at = |p: u32| (p > 0).then(|| hashes[(p / unit - 1) as usize]);
        if !checkpoint && self.open {
            if let Some(EventRecord {
                event:
                    CacheEvent::BlockStored {
                        group: g,
                        blocks,
                        keys,
                        token_end,
                        checkpoint: false,
                        tokens: run_tokens,
                        multimodal,
                        ..
                    },
                ..
            }) = self.pending.back_mut()
            {
                if *g == group
                    && *token_end == token_start
                    && keys.last() == digest_at(token_start).as_ref()
                {
                    keys.push(digest);
                    blocks.push(block);
                    run_tokens.extend_from_slice(&tokens[token_start as usize..position as usize]);
                    *token_end = position;
                    // Inputs starting before `token_start` that reach into the extension
                    // overlap the run already, and are in it.
                    multimodal.extend(
                        extra
                            .multimodal
                            .iter()
                            .filter(|m| m.start >= token_start && m.start < position)
                            .cloned(),
                    );
                    return;
                }
            }
        }
        let run_from = token_start / self.format.block_size * self.format.block_size;
        let mut keys = self.spare_digests.pop().unwrap_or_default();
        keys.push(digest);
        let mut blocks = self.spare_blocks.pop().unwrap_or_default();
        blocks.push(block);
        let mut run_tokens = self.spare_tokens.pop().unwrap_or_default();
        run_tokens.extend_from_slice(&tokens[run_from as usize..position as usize]);
        let cache_salt = if token_start == 0 { extra.cache_salt.clone() } else { None };
        let multimodal = extra
            .multimodal
            .iter()
            .filter(|m| m.start < position && m.end > run_from)
            .cloned()
            .collect();
        self.push(CacheEvent::BlockStored {
            group,
            block,
            blocks,
            keys,
            parent: digest_at(token_start),
            token_start,
            token_end: position,
            checkpoint,
            tokens: run_tokens,
            tokens_start: run_from,
            wire_parent: digest_at(run_from),
            lora_id: extra.lora_id,
            cache_salt,
            multimodal,
        });
        self.open = !checkpoint;
    }

    /// Ends the current run: the next key starts a new `BlockStored` (called when a
    /// sequence's commit is done, so that a run is one sequence's, of one commit).
    #[inline]
    pub fn seal(&mut self) {
        self.open = false;
    }

    /// Records the eviction of `block` of `group`, which lost `lost`; `still_held(key)` says
    /// whether another block of the group still carries a key.
    pub(crate) fn removed(
        &mut self,
        group: u32,
        block: BlockId,
        lost: &[BlockKey],
        still_held: impl Fn(&BlockKey) -> bool,
    ) {
        if !self.enabled {
            return;
        }
        let mut keys = self.spare_digests.pop().unwrap_or_default();
        keys.extend(lost.iter().map(|k| k.key.digest));
        let mut gone = self.spare_digests.pop().unwrap_or_default();
        let w = self.format.block_size;
        gone.extend(
            lost.iter().filter(|k| k.position % w == 0 && !still_held(k)).map(|k| k.key.digest),
        );
        self.push(CacheEvent::BlockRemoved { group, block, keys, gone });
    }

    fn recycle(&mut self, event: CacheEvent) {
        /// Spare vectors kept of each kind (enough for a step's events).
        const KEEP: usize = 1024;
        fn give<T>(mut v: Vec<T>, spare: &mut Vec<Vec<T>>) {
            if spare.len() < KEEP {
                v.clear();
                spare.push(v);
            }
        }
        match event {
            CacheEvent::BlockStored { keys, blocks, tokens, .. } => {
                give(keys, &mut self.spare_digests);
                give(blocks, &mut self.spare_blocks);
                give(tokens, &mut self.spare_tokens);
            }
            CacheEvent::BlockRemoved { keys, gone, .. } => {
                give(keys, &mut self.spare_digests);
                give(gone, &mut self.spare_digests);
            }
            CacheEvent::AllBlocksCleared => {}
        }
    }

    /// Takes every pending event, oldest first.
    pub fn drain(&mut self) -> Vec<EventRecord> {
        self.open = false;
        self.pending.drain(..).collect()
    }

    /// Takes every pending event and appends them to `out` as one vLLM `KVEventBatch`
    /// (msgpack, see [`encode_batch`]); appends nothing when none is pending. Returns the
    /// number of events taken and the number of wire events written.
    pub fn drain_wire(&mut self, ts: f64, rank: Option<i64>, out: &mut Vec<u8>) -> (usize, usize) {
        if self.pending.is_empty() {
            return (0, 0);
        }
        self.open = false;
        let taken = self.pending.len();
        let (slices, _) = self.pending.as_slices();
        let written = if slices.len() == taken {
            encode_batch(slices, &self.format, ts, rank, out)
        } else {
            self.pending.make_contiguous();
            encode_batch(self.pending.as_slices().0, &self.format, ts, rank, out)
        };
        let drained: Vec<EventRecord> = self.pending.drain(..).collect();
        for record in drained {
            self.recycle(record.event);
        }
        (taken, written)
    }

    /// Events dropped because nobody drained them in time.
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

// --- the wire encoding -------------------------------------------------------------------------

/// Whether `event` has a wire form (a run or an eviction touching a wire-block boundary).
fn on_wire(event: &CacheEvent, format: &WireFormat) -> bool {
    match event {
        CacheEvent::BlockStored { token_start, token_end, .. } => {
            let w = format.block_size;
            // A wire boundary q with token_start < q <= token_end.
            token_end / w > token_start / w
        }
        CacheEvent::BlockRemoved { gone, .. } => !gone.is_empty(),
        CacheEvent::AllBlocksCleared => true,
    }
}

/// Appends one vLLM 0.33 `KVEventBatch` holding `records`' wire events to `out`, byte for byte
/// as vLLM's msgspec encoder writes it: an array `[ts, [events...], data_parallel_rank]` (the
/// rank written, nil included); each event a map whose first key is `"type"`, with every field
/// vLLM writes even when nil (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`,
/// `lora_id`, `medium`, `lora_name` for a store; `block_hashes`, `medium` for a removal), then
/// the optional ones that are set. A store's map header is a map16, as msgspec writes it for a
/// struct of more than 15 fields; the others are fixmaps. Hash values are the u64 ids of
/// [`WireFormat::id`]. Returns the number of events written.
pub fn encode_batch(
    records: &[EventRecord],
    format: &WireFormat,
    ts: f64,
    rank: Option<i64>,
    out: &mut Vec<u8>,
) -> usize {
    let count = records.iter().filter(|r| on_wire(&r.event, format)).count();
    out.push(0x93);
    out.push(0xcb);
    out.extend_from_slice(&ts.to_bits().to_be_bytes());
    array_header(out, count);
    for record in records {
        if on_wire(&record.event, format) {
            encode_event(&record.event, format, out);
        }
    }
    match rank {
        Some(r) => int(out, r),
        None => out.push(0xc0),
    }
    count
}

/// A store's map: the run's wire blocks (those ending at a multiple of W in the run).
fn encode_stored(event: &CacheEvent, format: &WireFormat, out: &mut Vec<u8>) {
    let (w, unit) = (format.block_size, format.unit);
    let CacheEvent::BlockStored {
        group,
        keys,
        token_start,
        token_end,
        tokens,
        tokens_start,
        wire_parent,
        lora_id,
        cache_salt,
        multimodal,
        ..
    } = event
    else {
        return;
    };
    let kind = format.kinds.get(*group as usize).copied().unwrap_or(WireKind::FullAttention);
    // Wire blocks end at the multiples of W in (token_start, token_end].
    let first_end = (token_start / w + 1) * w;
    let last_end = token_end / w * w;
    let n = ((last_end - first_end) / w + 1) as usize;
    let salted = cache_salt.is_some() && first_end == w;
    // vLLM's per-block extra keys: each multimodal input overlapping the block as (its hash,
    // its start less the block's), then the salt on the sequence's first block.
    let overlapping =
        |end: u32| multimodal.iter().filter(move |m| m.start < end && m.end > end - w);
    let with_extra =
        salted || (0..n).any(|i| overlapping(first_end + i as u32 * w).next().is_some());
    let mut fields = 10;
    fields += usize::from(with_extra);
    fields += usize::from(matches!(kind, WireKind::SlidingWindow(_)));
    fields += usize::from(kind == WireKind::Mamba);
    out.push(0xde);
    out.extend_from_slice(&(fields as u16).to_be_bytes());
    string(out, "type");
    string(out, "BlockStored");
    string(out, "block_hashes");
    array_header(out, n);
    for i in 0..n {
        let end = first_end + i as u32 * w;
        let key = &keys[((end - token_start) / unit - 1) as usize];
        uint(out, format.id(key));
    }
    string(out, "parent_block_hash");
    match wire_parent {
        Some(p) => uint(out, format.id(p)),
        None => out.push(0xc0),
    }
    string(out, "token_ids");
    let from = (first_end - w - tokens_start) as usize;
    let to = (last_end - tokens_start) as usize;
    array_header(out, to - from);
    for &t in &tokens[from..to] {
        uint(out, u64::from(t));
    }
    string(out, "block_size");
    uint(out, u64::from(w));
    string(out, "lora_id");
    match lora_id {
        Some(id) => uint(out, *id),
        None => out.push(0xc0),
    }
    string(out, "medium");
    string(out, "GPU");
    string(out, "lora_name");
    out.push(0xc0);
    if with_extra {
        // One entry per block (nil for a block without any), as vLLM does.
        string(out, "extra_keys");
        array_header(out, n);
        for i in 0..n {
            let end = first_end + i as u32 * w;
            let salt = cache_salt.as_deref().filter(|_| salted && i == 0);
            let count = overlapping(end).count() + usize::from(salt.is_some());
            if count == 0 {
                out.push(0xc0);
                continue;
            }
            array_header(out, count);
            for m in overlapping(end) {
                out.push(0x92);
                text_or_bin(out, &m.hash);
                int(out, i64::from(m.start) - i64::from(end - w));
            }
            if let Some(salt) = salt {
                text_or_bin(out, salt);
            }
        }
    }
    string(out, "group_idx");
    uint(out, u64::from(*group));
    string(out, "kv_cache_spec_kind");
    string(out, kind.name());
    if let WireKind::SlidingWindow(window) = kind {
        string(out, "kv_cache_spec_sliding_window");
        uint(out, u64::from(window));
    }
    if kind == WireKind::Mamba {
        // Where the checkpoint's state resumes (a key current routers ignore).
        string(out, "position");
        uint(out, u64::from(*token_end));
    }
}

fn encode_event(event: &CacheEvent, format: &WireFormat, out: &mut Vec<u8>) {
    match event {
        CacheEvent::BlockStored { .. } => encode_stored(event, format, out),
        CacheEvent::BlockRemoved { group, gone, .. } => {
            out.push(0x84);
            string(out, "type");
            string(out, "BlockRemoved");
            string(out, "block_hashes");
            array_header(out, gone.len());
            for key in gone {
                uint(out, format.id(key));
            }
            string(out, "medium");
            string(out, "GPU");
            string(out, "group_idx");
            uint(out, u64::from(*group));
        }
        CacheEvent::AllBlocksCleared => {
            out.push(0x81);
            string(out, "type");
            string(out, "AllBlocksCleared");
        }
    }
}

fn array_header(out: &mut Vec<u8>, n: usize) {
    if n < 16 {
        out.push(0x90 | n as u8);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(0xdc);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

/// A byte string as msgpack str when it is UTF-8 (vLLM's identifiers and salts are `str`), else
/// as bin.
fn text_or_bin(out: &mut Vec<u8>, b: &[u8]) {
    match std::str::from_utf8(b) {
        Ok(text) => string(out, text),
        Err(_) => bin(out, b),
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if let Ok(n) = u8::try_from(n) {
        out.push(0xd9);
        out.push(n);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(0xda);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

fn bin(out: &mut Vec<u8>, b: &[u8]) {
    let n = b.len();
    if let Ok(n) = u8::try_from(n) {
        out.push(0xc4);
        out.push(n);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(0xc5);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(0xc6);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(b);
}

/// An unsigned integer in its shortest msgpack form (as msgspec writes it).
fn uint(out: &mut Vec<u8>, v: u64) {
    if v < 128 {
        out.push(v as u8);
    } else if let Ok(v) = u8::try_from(v) {
        out.push(0xcc);
        out.push(v);
    } else if let Ok(v) = u16::try_from(v) {
        out.push(0xcd);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(v) {
        out.push(0xce);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn int(out: &mut Vec<u8>, v: i64) {
    if let Ok(u) = u64::try_from(v) {
        uint(out, u);
    } else if v >= -32 {
        out.push(v as u8);
    } else if let Ok(v) = i8::try_from(v) {
        out.push(0xd0);
        out.push(v as u8);
    } else if let Ok(v) = i16::try_from(v) {
        out.push(0xd1);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = i32::try_from(v) {
        out.push(0xd2);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        use std::fmt::Write;
        bytes.iter().fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }

    /// The test vector vLLM 0.33.0's own structs encode: a store of one block (hash
    /// 0x1234567890abcdef, tokens 1..4, block size 4, medium GPU, group 0, full attention), the
    /// removal of that hash, a clear; ts 1.5, rank 0.
    #[test]
    fn vllm_test_vector() {
        const VECTOR: &str = "93cb3ff800000000000093de000aa474797065ab426c6f636b53746f726564ac\
            626c6f636b5f68617368657391cf1234567890abcdefb1706172656e745f626c6f636b5f68617368c0a97\
            46f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3\
            475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e\
            64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68\
            617368657391cf1234567890abcdefa66d656469756da3475055a967726f75705f6964780081a474797065\
            b0416c6c426c6f636b73436c656172656400";
        let mut digest = Digest([0; 32]);
        digest.0[8..16].copy_from_slice(&0x1234_5678_90ab_cdef_u64.to_be_bytes());
        let format = WireFormat {
            block_size: 4,
            unit: 4,
            digest_len: 16,
            kinds: vec![WireKind::FullAttention],
        };
        let mut log = EventLog::new(true, 16, format);
        log.stored_key(0, 7, 4, false, &[1, 2, 3, 4], &[digest], &ExtraKeys::default());
        let key = BlockKey { key: crate::pool::Key { group: 0, digest }, position: 4 };
        log.removed(0, 7, &[key], |_| false);
        log.push(CacheEvent::AllBlocksCleared);
        let mut out = Vec::new();
        assert_eq!(log.drain_wire(1.5, Some(0), &mut out), (3, 3));
        assert_eq!(hex(&out), VECTOR);
    }

    #[test]
    fn ids_are_the_low_64_bits_and_never_zero() {
        let f = |len| WireFormat { block_size: 1, unit: 1, digest_len: len, kinds: vec![] };
        let mut d = Digest([0; 32]);
        d.0[15] = 5;
        assert_eq!(f(16).id(&d), 5);
        assert_eq!(f(32).id(&d), 1, "bytes 16..32 are zero: id 1");
        d.0[31] = 9;
        assert_eq!(f(32).id(&d), 9);
        let mut z = Digest([0; 32]);
        z.0[0] = 3;
        assert_eq!(f(16).id(&z), 3 << 56, "low word 0: the word above it");
    }

    #[test]
    fn runs_merge_and_wire_blocks_take_their_tokens() {
        let digests: Vec<Digest> = (1..=8u8)
            .map(|i| {
                let mut d = Digest([0; 32]);
                d.0[15] = i;
                d
            })
            .collect();
        let tokens: Vec<u32> = (100..132).collect();
        // U = 4, W = 8: keys at 12, 16, 20, 24 (one run across blocks 1 and 2).
        let format = WireFormat {
            block_size: 8,
            unit: 4,
            digest_len: 16,
            kinds: vec![WireKind::FullAttention],
        };
        let mut log = EventLog::new(true, 16, format);
        for (position, block) in [(12, 1), (16, 1), (20, 2), (24, 2)] {
            log.stored_key(0, block, position, false, &tokens, &digests, &ExtraKeys::default());
        }
        let events = log.drain();
        assert_eq!(events.len(), 1, "{events:?}");
        let CacheEvent::BlockStored { blocks, keys, tokens: t, tokens_start, wire_parent, .. } =
            &events[0].event
        else {
            panic!("{events:?}")
        };
        assert_eq!(blocks, &[1, 1, 2, 2]);
        assert_eq!(keys, &digests[2..6]);
        assert_eq!((*tokens_start, t.as_slice()), (8, &tokens[8..24]));
        assert_eq!(wire_parent, &Some(digests[1]));
        let mut out = Vec::new();
        encode_batch(&events, log.format(), 0.0, None, &mut out);
        // Wire blocks end at 16 and 24: hashes 4 and 6, parent 2, tokens 108..124.
        let hashes = [0x92, 0x04, 0x06];
        assert!(out.windows(3).any(|w| w == hashes), "{}", hex(&out));
        assert!(hex(&out).contains("a9746f6b656e5f696473dc00106c6d"), "{}", hex(&out));
        assert_eq!(out.last(), Some(&0xc0), "rank nil is written");
    }
}
