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
//! Pending events are a ring of records written in place: drained through
//! [`EventLog::drain_wire`], a record stays in its slot for the next event, so recording
//! allocates nothing once warm, and the wire bytes are written in place into a buffer the
//! caller keeps.

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
    /// them, or 1. (`digest_len` is read as 16 to 32: every algorithm's is 16 or 32.)
    #[must_use]
    #[inline]
    pub fn id(&self, digest: &Digest) -> u64 {
        let end = self.digest_len.clamp(16, 32);
        let word = |end: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&digest.0[end - 8..end]);
            u64::from_be_bytes(w)
        };
        match (word(end), word(end - 8)) {
            (0, 0) => 1,
            (0, high) => high,
            (low, _) => low,
        }
    }
}

/// What [`EventLog::drain_wire`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WireDrain {
    /// The batch is `buf[..bytes]` (0 when nothing was pending).
    pub bytes: usize,
    /// Events taken.
    pub taken: usize,
    /// Wire events written (a run or eviction with no wire-block boundary has no wire form).
    pub written: usize,
}

/// A bounded queue of events, kept in a ring of records written in place: a drained record
/// stays in its slot with its vectors, and the event written there next clears and refills
/// them, so that recording and draining neither allocate, move nor drop an event once warm.
#[derive(Clone, Debug)]
pub struct EventLog {
    enabled: bool,
    capacity: usize,
    next_sequence: u64,
    dropped: u64,
    /// The ring: the pending events are the `len` records from `head` on (wrapping); the
    /// other slots hold drained records whose vectors the next events reuse. `head` is below
    /// the slot count (or 0), and at most `capacity` (at least 1) slots are pending.
    slots: Vec<EventRecord>,
    head: usize,
    len: usize,
    format: WireFormat,
    /// Whether the last pending event is a run the next key may extend (until `seal`).
    open: bool,
    spare: Spare,
}

/// Vectors of events whose slot now holds another kind of event, cleared, for the next ones.
#[derive(Clone, Debug, Default)]
struct Spare {
    digests: Vec<Vec<Digest>>,
    blocks: Vec<Vec<BlockId>>,
    tokens: Vec<Vec<u32>>,
}

impl Spare {
    /// Spare vectors kept of each kind.
    const KEEP: usize = 1024;

    /// Takes `event`'s vectors.
    fn take(&mut self, event: CacheEvent) {
        fn give<T>(mut v: Vec<T>, spare: &mut Vec<Vec<T>>) {
            if spare.len() < Spare::KEEP && v.capacity() > 0 {
                v.clear();
                spare.push(v);
            }
        }
        match event {
            CacheEvent::BlockStored { keys, blocks, tokens, .. } => {
                give(keys, &mut self.digests);
                give(blocks, &mut self.blocks);
                give(tokens, &mut self.tokens);
            }
            CacheEvent::BlockRemoved { keys, gone, .. } => {
                give(keys, &mut self.digests);
                give(gone, &mut self.digests);
            }
            CacheEvent::AllBlocksCleared => {}
        }
    }

    /// An empty run, its vectors from the spares.
    fn stored(&mut self) -> CacheEvent {
        CacheEvent::BlockStored {
            group: 0,
            block: 0,
            blocks: self.blocks.pop().unwrap_or_default(),
            keys: self.digests.pop().unwrap_or_default(),
            parent: None,
            token_start: 0,
            token_end: 0,
            checkpoint: false,
            tokens: self.tokens.pop().unwrap_or_default(),
            tokens_start: 0,
            wire_parent: None,
            lora_id: None,
            cache_salt: None,
            multimodal: Vec::new(),
        }
    }

    /// An empty removal, its vectors from the spares.
    fn removed(&mut self) -> CacheEvent {
        CacheEvent::BlockRemoved {
            group: 0,
            block: 0,
            keys: self.digests.pop().unwrap_or_default(),
            gone: self.digests.pop().unwrap_or_default(),
        }
    }
}

impl EventLog {
    /// Slots kept when the events are drained to the wire (enough for a step's events); the
    /// others are freed.
    const KEEP: usize = 1024;

    #[must_use]
    pub fn new(enabled: bool, capacity: usize, format: WireFormat) -> Self {
        Self {
            enabled,
            capacity,
            next_sequence: 0,
            dropped: 0,
            slots: Vec::new(),
            head: 0,
            len: 0,
            format,
            open: false,
            spare: Spare::default(),
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

    /// The pending records, oldest first: the ring's two parts.
    fn pending(&self) -> (&[EventRecord], &[EventRecord]) {
        let n = self.slots.len();
        if self.head + self.len <= n {
            (&self.slots[self.head..self.head + self.len], &[])
        } else {
            (&self.slots[self.head..], &self.slots[..self.head + self.len - n])
        }
    }

    /// Numbers a new event and gives the index of its slot: a drained one, a new one, or, when
    /// `capacity` are pending, the oldest pending event's (dropped and counted). The slot
    /// still holds its earlier record, for its vectors.
    #[inline]
    fn next_slot(&mut self) -> usize {
        self.open = false;
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        let n = self.slots.len();
        let index = if self.len >= self.capacity.max(1) {
            // Every slot is pending (slots are added only below the capacity): the oldest
            // makes room for the newest.
            self.dropped += 1;
            let oldest = self.head;
            self.head = (self.head + 1) % n;
            oldest
        } else if self.len < n {
            let index = (self.head + self.len) % n;
            self.len += 1;
            index
        } else {
            self.slots.rotate_left(self.head);
            self.head = 0;
            self.slots.push(EventRecord { sequence, event: CacheEvent::AllBlocksCleared });
            self.len += 1;
            n
        };
        self.slots[index].sequence = sequence;
        index
    }

    pub fn push(&mut self, event: CacheEvent) {
        if !self.enabled {
            return;
        }
        let index = self.next_slot();
        let old = std::mem::replace(&mut self.slots[index].event, event);
        self.spare.take(old);
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
        if !checkpoint && self.open && self.len > 0 {
            let last = (self.head + self.len - 1) % self.slots.len();
            if let CacheEvent::BlockStored {
                group: g,
                blocks,
                keys,
                token_end,
                checkpoint: false,
                tokens: run_tokens,
                multimodal,
                ..
            } = &mut self.slots[last].event
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
        let first_parent = digest_at(token_start);
        let first_wire_parent =
            if run_from == token_start { first_parent } else { digest_at(run_from) };
        let index = self.next_slot();
        let event = &mut self.slots[index].event;
        if !matches!(event, CacheEvent::BlockStored { .. }) {
            let old = std::mem::replace(event, self.spare.stored());
            self.spare.take(old);
        }
        if let CacheEvent::BlockStored {
            group: g,
            block: b,
            blocks,
            keys,
            parent,
            token_start: start,
            token_end,
            checkpoint: c,
            tokens: run_tokens,
            tokens_start,
            wire_parent,
            lora_id,
            cache_salt,
            multimodal,
        } = event
        {
            *g = group;
            *b = block;
            blocks.clear();
            blocks.push(block);
            keys.clear();
            keys.push(digest);
            *parent = first_parent;
            *start = token_start;
            *token_end = position;
            *c = checkpoint;
            run_tokens.clear();
            run_tokens.extend_from_slice(&tokens[run_from as usize..position as usize]);
            *tokens_start = run_from;
            *wire_parent = first_wire_parent;
            *lora_id = extra.lora_id;
            if token_start == 0 {
                cache_salt.clone_from(&extra.cache_salt);
            } else {
                *cache_salt = None;
            }
            multimodal.clear();
            if !extra.multimodal.is_empty() {
                multimodal.extend(
                    extra
                        .multimodal
                        .iter()
                        .filter(|m| m.start < position && m.end > run_from)
                        .cloned(),
                );
            }
        }
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
        let w = self.format.block_size;
        let index = self.next_slot();
        let event = &mut self.slots[index].event;
        if !matches!(event, CacheEvent::BlockRemoved { .. }) {
            let old = std::mem::replace(event, self.spare.removed());
            self.spare.take(old);
        }
        if let CacheEvent::BlockRemoved { group: g, block: b, keys, gone } = event {
            *g = group;
            *b = block;
            keys.clear();
            keys.extend(lost.iter().map(|k| k.key.digest));
            gone.clear();
            gone.extend(
                lost.iter().filter(|k| k.position % w == 0 && !still_held(k)).map(|k| k.key.digest),
            );
        }
    }

    /// Takes every pending event, oldest first.
    pub fn drain(&mut self) -> Vec<EventRecord> {
        self.open = false;
        self.slots.rotate_left(self.head);
        self.slots.truncate(self.len);
        (self.head, self.len) = (0, 0);
        std::mem::take(&mut self.slots)
    }

    /// Takes every pending event and writes them as one vLLM `KVEventBatch` (msgpack, see
    /// [`encode_batch`]) at the start of `buf`, in place (see [`encode_batch_into`]: a buffer
    /// kept from one drain to the next is not cleared, reallocated or copied); writes nothing
    /// when none is pending. The drained records stay in their slots for the next events.
    pub fn drain_wire(&mut self, ts: f64, rank: Option<i64>, buf: &mut Vec<u8>) -> WireDrain {
        if self.len == 0 {
            return WireDrain::default();
        }
        self.open = false;
        let taken = self.len;
        let (older, newer) = self.pending();
        let (bytes, written) = encode_into(older.iter().chain(newer), &self.format, ts, rank, buf);
        (self.head, self.len) = (0, 0);
        self.slots.truncate(Self::KEEP);
        WireDrain { bytes, taken, written }
    }

    /// Events dropped because nobody drained them in time.
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

// --- the wire encoding -------------------------------------------------------------------------
//
// A hand-written encoder for one fixed schema: every key is a constant, so each event is a few
// constant byte strings and the integers between them. A generic msgpack crate would write the
// same bytes key by key, checking capacity and dispatching on each value; here the payload's
// size is bounded once per batch and each item is one fixed-size store into it (a token, of
// whatever width, is one 8-byte store and an advance by its width).

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

/// Bytes an event's wire form is expected to take (an estimate: `encode_batch_into` measures
/// and writes again past it).
fn size_hint(event: &CacheEvent) -> usize {
    match event {
        CacheEvent::BlockStored { keys, tokens, .. } => 240 + 9 * keys.len() + 5 * tokens.len(),
        CacheEvent::BlockRemoved { gone, .. } => 64 + 9 * gone.len(),
        CacheEvent::AllBlocksCleared => 24,
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
    let mut buf = Vec::new();
    let (bytes, written) = encode_batch_into(records, format, ts, rank, &mut buf);
    out.extend_from_slice(&buf[..bytes]);
    written
}

/// [`encode_batch`] written at the start of `buf`, in place: `buf` is lengthened (never
/// shortened) until the batch fits, and what lies past the batch is left as it was, so a
/// buffer kept across calls is neither cleared nor reallocated once it has held the largest
/// batch. Returns the batch's size (it is `buf[..size]`) and the number of events written.
pub fn encode_batch_into(
    records: &[EventRecord],
    format: &WireFormat,
    ts: f64,
    rank: Option<i64>,
    buf: &mut Vec<u8>,
) -> (usize, usize) {
    encode_into(records.iter(), format, ts, rank, buf)
}

/// [`encode_batch_into`] of the records `records` gives, in order.
fn encode_into<'r>(
    records: impl Iterator<Item = &'r EventRecord> + Clone,
    format: &WireFormat,
    ts: f64,
    rank: Option<i64>,
    buf: &mut Vec<u8>,
) -> (usize, usize) {
    let (mut count, mut hint) = (0, 32);
    for record in records.clone() {
        if on_wire(&record.event, format) {
            count += 1;
            hint += size_hint(&record.event);
        }
    }
    if buf.len() < hint {
        buf.resize(hint, 0);
    }
    let mut size = write_batch(records.clone(), count, format, ts, rank, buf);
    if size + Writer::SLACK > buf.len() {
        // Past the expected size: the first pass measured the batch, the second fits.
        buf.resize(size + Writer::SLACK, 0);
        let measured = size;
        size = write_batch(records, count, format, ts, rank, buf);
        debug_assert_eq!(size, measured, "the first pass measures the batch exactly");
    }
    (size, count)
}

/// Writes the batch of `records`, `count` of which have a wire form, at the start of `buf` as
/// far as it fits; returns its full size (every byte is in `buf` when the size plus
/// [`Writer::SLACK`] is within it).
fn write_batch<'r>(
    records: impl Iterator<Item = &'r EventRecord>,
    count: usize,
    format: &WireFormat,
    ts: f64,
    rank: Option<i64>,
    buf: &mut [u8],
) -> usize {
    let len = buf.len();
    let mut w = Writer { rest: buf, missing: 0 };
    let mut head = [0u8; 10];
    head[0] = 0x93;
    head[1] = 0xcb;
    head[2..].copy_from_slice(&ts.to_bits().to_be_bytes());
    w.put(head);
    w.array_header(count);
    let mut tail = Tail::NONE;
    for record in records {
        if on_wire(&record.event, format) {
            encode_event(&record.event, format, &mut tail, &mut w);
        }
    }
    match rank {
        Some(r) => w.int(r),
        None => w.put([NIL]),
    }
    len - w.rest.len() + w.missing
}

const NIL: u8 = 0xc0;

/// The msgpack strings `parts`, each a fixstr, one after another (`N` their total size).
const fn fixstrs<const N: usize>(parts: &[&str]) -> [u8; N] {
    let mut out = [0u8; N];
    let (mut at, mut p) = (0, 0);
    while p < parts.len() {
        let s = parts[p].as_bytes();
        assert!(s.len() < 32, "a fixstr holds at most 31 bytes");
        out[at] = 0xa0 | s.len() as u8;
        at += 1;
        let mut i = 0;
        while i < s.len() {
            out[at] = s[i];
            at += 1;
            i += 1;
        }
        p += 1;
    }
    assert!(at == N, "N is the strings' total size");
    out
}

const STORED_HEAD: [u8; 30] = fixstrs(&["type", "BlockStored", "block_hashes"]);
/// A map16 header (its field count at byte 2), [`STORED_HEAD`] and a fixarray header (its
/// length at byte 33).
const STORED_PREFIX: [u8; 34] = {
    let mut out = [0u8; 34];
    out[0] = 0xde;
    let mut i = 0;
    while i < 30 {
        out[3 + i] = STORED_HEAD[i];
        i += 1;
    }
    out[33] = 0x90;
    out
};
/// `parent_block_hash`: nil, then the `token_ids` key.
const NO_PARENT: [u8; 29] = {
    let mut out = [0u8; 29];
    let (parent, tokens) = (fixstrs::<18>(&["parent_block_hash"]), fixstrs::<10>(&["token_ids"]));
    let mut i = 0;
    while i < 18 {
        out[i] = parent[i];
        i += 1;
    }
    out[18] = NIL;
    while i < 28 {
        out[i + 1] = tokens[i - 18];
        i += 1;
    }
    out
};
/// `parent_block_hash`: a uint 64 (its 8 bytes at 19..27), then the `token_ids` key.
const WIDE_PARENT: [u8; 37] = {
    let mut out = [0u8; 37];
    let mut i = 0;
    while i < 18 {
        out[i] = NO_PARENT[i];
        i += 1;
    }
    out[18] = 0xcf;
    while i < 28 {
        out[i + 9] = NO_PARENT[i + 1];
        i += 1;
    }
    out
};
const PARENT: [u8; 18] = fixstrs(&["parent_block_hash"]);
const TOKEN_IDS: [u8; 10] = fixstrs(&["token_ids"]);
const BLOCK_SIZE: [u8; 11] = fixstrs(&["block_size"]);
const LORA_ID: [u8; 8] = fixstrs(&["lora_id"]);
const MEDIUM_LORA_NAME: [u8; 21] = fixstrs(&["medium", "GPU", "lora_name"]);
const EXTRA_KEYS: [u8; 11] = fixstrs(&["extra_keys"]);
const GROUP_IDX: [u8; 10] = fixstrs(&["group_idx"]);
const KIND_FULL: [u8; 34] = fixstrs(&["kv_cache_spec_kind", "full_attention"]);
const KIND_SLIDING: [u8; 63] =
    fixstrs(&["kv_cache_spec_kind", "sliding_window", "kv_cache_spec_sliding_window"]);
const KIND_MAMBA: [u8; 34] = fixstrs(&["kv_cache_spec_kind", "mamba", "position"]);
const REMOVED_HEAD: [u8; 31] = fixstrs(&["type", "BlockRemoved", "block_hashes"]);
const MEDIUM_GPU_GROUP_IDX: [u8; 21] = fixstrs(&["medium", "GPU", "group_idx"]);
const CLEARED: [u8; 22] = fixstrs(&["type", "AllBlocksCleared"]);

/// A store's map after its token ids, when it has no extra keys: `block_size`, `lora_id`,
/// `medium`, `lora_name`, `group_idx` and the kind's keys (up to a `mamba` kind's `position`
/// key, whose value is the store's own), the same for every store of one group and `LoRA` id;
/// a batch builds it again when the pair changes from one store to the next.
struct Tail {
    key: Option<(u32, Option<u64>)>,
    bytes: [u8; Tail::MAX],
    /// Bytes used (0: longer than `MAX`, which a sliding window's tail with wide numbers can
    /// be: such stores take the general path).
    len: usize,
}

impl Tail {
    /// At most 128 bytes, copied inline (a full-attention or mamba tail takes at most 108, a
    /// sliding window's at most 136).
    const MAX: usize = 128;

    const NONE: Self = Self { key: None, bytes: [0; Self::MAX], len: 0 };

    fn new(format: &WireFormat, group: u32, kind: WireKind, lora_id: Option<u64>) -> Self {
        let mut bytes = [0; Self::MAX];
        let mut w = Writer { rest: &mut bytes, missing: 0 };
        stored_fields_after_tokens(&mut w, format, lora_id);
        stored_group_and_kind(&mut w, group, kind);
        let len = if w.missing == 0 { Self::MAX - w.rest.len() } else { 0 };
        Self { key: Some((group, lora_id)), bytes, len }
    }
}

/// A store's map: the run's wire blocks (those ending at a multiple of W in the run).
#[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
#[inline(always)]
fn encode_stored(event: &CacheEvent, format: &WireFormat, tail: &mut Tail, w: &mut Writer<'_>) {
    let (size, unit) = (format.block_size, format.unit);
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
    let first_end = (token_start / size + 1) * size;
    let last_end = token_end / size * size;
    let n = ((last_end - first_end) / size + 1) as usize;
    let salted = cache_salt.is_some() && first_end == size;
    // vLLM's per-block extra keys: each multimodal input overlapping the block as (its hash,
    // its start less the block's), then the salt on the sequence's first block.
    let overlapping =
        |end: u32| multimodal.iter().filter(move |m| m.start < end && m.end > end - size);
    let with_extra = salted
        || (!multimodal.is_empty()
            && (0..n).any(|i| overlapping(first_end + i as u32 * size).next().is_some()));
    let fields = 10
        + u16::from(with_extra)
        + u16::from(matches!(kind, WireKind::SlidingWindow(_)))
        + u16::from(kind == WireKind::Mamba);
    // The map header (a map16 of at most 13 fields), the keys up to `block_hashes` and, below
    // 16 blocks, the array header of their ids: one store.
    let mut head = STORED_PREFIX;
    head[2] = fields as u8;
    if n < 16 {
        head[33] = 0x90 | n as u8;
        w.put(head);
    } else {
        w.put_prefix(&head, 33);
        w.array_header(n);
    }
    if n == 1 {
        w.uint(format.id(&keys[((first_end - token_start) / unit - 1) as usize]));
    } else {
        let per_block = (size / unit) as usize;
        let first = ((first_end - token_start) / unit - 1) as usize;
        for key in keys[first..].iter().step_by(per_block).take(n) {
            w.uint(format.id(key));
        }
    }
    // `parent_block_hash`, its value and the `token_ids` key: one store when the parent is
    // nil or a 64-bit id (almost always: an id below 2^32 has odds 2^-32).
    match wire_parent.as_ref().map(|p| format.id(p)) {
        None => w.put(NO_PARENT),
        Some(id) if id > u64::from(u32::MAX) => {
            let mut bytes = WIDE_PARENT;
            bytes[19..27].copy_from_slice(&id.to_be_bytes());
            w.put(bytes);
        }
        Some(id) => {
            w.put(PARENT);
            w.uint(id);
            w.put(TOKEN_IDS);
        }
    }
    let from = (first_end - size - tokens_start) as usize;
    let to = (last_end - tokens_start) as usize;
    w.array_header(to - from);
    w.tokens(&tokens[from..to]);
    if !with_extra {
        if tail.key != Some((*group, *lora_id)) {
            *tail = Tail::new(format, *group, kind, *lora_id);
        }
        if tail.len > 0 {
            w.put_prefix(&tail.bytes, tail.len);
            if kind == WireKind::Mamba {
                w.uint(u64::from(*token_end));
            }
            return;
        }
    }
    stored_fields_after_tokens(w, format, *lora_id);
    if with_extra {
        extra_keys(first_end, n, size, cache_salt.as_deref().filter(|_| salted), multimodal, w);
    }
    stored_group_and_kind(w, *group, kind);
    if kind == WireKind::Mamba {
        // Where the checkpoint's state resumes (a key current routers ignore).
        w.uint(u64::from(*token_end));
    }
}

/// A store's `block_size`, `lora_id`, `medium` and `lora_name` (what follows its token ids).
#[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
#[inline(always)]
fn stored_fields_after_tokens(w: &mut Writer<'_>, format: &WireFormat, lora_id: Option<u64>) {
    w.put(BLOCK_SIZE);
    w.uint(u64::from(format.block_size));
    w.put(LORA_ID);
    match lora_id {
        Some(id) => w.uint(id),
        None => w.put([NIL]),
    }
    w.put(MEDIUM_LORA_NAME);
    w.put([NIL]);
}

/// A store's `group_idx` and kind keys (a sliding window's with its window; a `mamba` kind's
/// up to the `position` key, whose value is the store's).
#[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
#[inline(always)]
fn stored_group_and_kind(w: &mut Writer<'_>, group: u32, kind: WireKind) {
    w.put(GROUP_IDX);
    w.uint(u64::from(group));
    match kind {
        WireKind::FullAttention => w.put(KIND_FULL),
        WireKind::SlidingWindow(window) => {
            w.put(KIND_SLIDING);
            w.uint(u64::from(window));
        }
        WireKind::Mamba => w.put(KIND_MAMBA),
    }
}

/// A store's `extra_keys`: per wire block (`n`, the first ending at `first_end`), each
/// multimodal input overlapping it as (its hash, its start less the block's), then the salt
/// on the sequence's first block; nil for a block without any, as vLLM does.
fn extra_keys(
    first_end: u32,
    n: usize,
    size: u32,
    salt: Option<&[u8]>,
    multimodal: &[MultimodalInput],
    w: &mut Writer<'_>,
) {
    let overlapping =
        |end: u32| multimodal.iter().filter(move |m| m.start < end && m.end > end - size);
    w.put(EXTRA_KEYS);
    w.array_header(n);
    for i in 0..n {
        let end = first_end + i as u32 * size;
        let salt = salt.filter(|_| i == 0);
        let count = overlapping(end).count() + usize::from(salt.is_some());
        if count == 0 {
            w.put([NIL]);
            continue;
        }
        w.array_header(count);
        for m in overlapping(end) {
            w.put([0x92]);
            w.text_or_bin(&m.hash);
            w.int(i64::from(m.start) - i64::from(end - size));
        }
        if let Some(salt) = salt {
            w.text_or_bin(salt);
        }
    }
}

#[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
#[inline(always)]
fn encode_event(event: &CacheEvent, format: &WireFormat, tail: &mut Tail, w: &mut Writer<'_>) {
    match event {
        CacheEvent::BlockStored { .. } => encode_stored(event, format, tail, w),
        CacheEvent::BlockRemoved { group, gone, .. } => {
            w.put([0x84]);
            w.put(REMOVED_HEAD);
            w.array_header(gone.len());
            for key in gone {
                w.uint(format.id(key));
            }
            w.put(MEDIUM_GPU_GROUP_IDX);
            w.uint(u64::from(*group));
        }
        CacheEvent::AllBlocksCleared => {
            w.put([0x81]);
            w.put(CLEARED);
        }
    }
}

/// Writes msgpack into a byte slice from its start, keeping the part not written yet. Every
/// store is of a fixed size (a token of any width is one 8-byte store, then the slice moves on
/// by the token's width), so each costs one comparison of the slice's length; a store that does
/// not fit is counted as missing instead of made, so the batch's full size is what was written
/// plus what is missing, and every byte is written when nothing is missing.
struct Writer<'a> {
    rest: &'a mut [u8],
    missing: usize,
}

impl Writer<'_> {
    /// Room a buffer needs past a batch for every store of it to fit (a token pair's 16
    /// bytes, stored where the pair starts, take at least 2).
    const SLACK: usize = 16;

    /// Stores `bytes` and moves past them.
    #[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
    #[inline(always)]
    fn put<const N: usize>(&mut self, bytes: [u8; N]) {
        let rest = std::mem::take(&mut self.rest);
        if let Some(dst) = rest.first_chunk_mut::<N>() {
            *dst = bytes;
            self.rest = &mut rest[N..];
        } else {
            // The room left stays: a later, smaller store may still fit in it, and the
            // batch's size is what was written plus what is missing.
            self.missing += N;
            self.rest = rest;
        }
    }

    /// Stores the 8 bytes of `word` and moves past its first `len` (at most 8).
    #[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
    #[inline(always)]
    fn put_word(&mut self, word: u64, len: usize) {
        let rest = std::mem::take(&mut self.rest);
        if let Some(dst) = rest.first_chunk_mut::<8>() {
            *dst = word.to_le_bytes();
            self.rest = &mut rest[len.min(8)..];
        } else {
            self.missing += len;
            self.rest = rest;
        }
    }

    /// Stores the first `len` of `bytes` (at most `N`), as one `N`-byte store when that much
    /// room is left.
    #[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
    #[inline(always)]
    fn put_prefix<const N: usize>(&mut self, bytes: &[u8; N], len: usize) {
        let len = len.min(N);
        let rest = std::mem::take(&mut self.rest);
        if let Some(dst) = rest.first_chunk_mut::<N>() {
            *dst = *bytes;
            self.rest = &mut rest[len..];
        } else {
            self.rest = rest;
            self.slice(&bytes[..len]);
        }
    }

    fn slice(&mut self, bytes: &[u8]) {
        let rest = std::mem::take(&mut self.rest);
        if bytes.len() <= rest.len() {
            let (dst, rest) = rest.split_at_mut(bytes.len());
            dst.copy_from_slice(bytes);
            self.rest = rest;
        } else {
            self.missing += bytes.len();
            self.rest = rest;
        }
    }

    /// Token ids, each in its shortest msgpack form (as msgspec writes them).
    #[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
    #[inline(always)]
    fn tokens(&mut self, tokens: &[u32]) {
        // Two at a time: one 16-byte room for both words, the second stored after the first's
        // width (at most 5 bytes in).
        let mut pairs = tokens.chunks_exact(2);
        for pair in &mut pairs {
            let (first, first_len) = uint32_word(pair[0]);
            let (second, second_len) = uint32_word(pair[1]);
            let first_len = first_len.min(8);
            let rest = std::mem::take(&mut self.rest);
            if let Some(dst) = rest.first_chunk_mut::<16>() {
                dst[..8].copy_from_slice(&first.to_le_bytes());
                dst[first_len..first_len + 8].copy_from_slice(&second.to_le_bytes());
                self.rest = &mut rest[(first_len + second_len).min(16)..];
            } else {
                self.missing += first_len + second_len;
                self.rest = rest;
            }
        }
        for &t in pairs.remainder() {
            let (word, len) = uint32_word(t);
            self.put_word(word, len);
        }
    }

    #[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
    #[inline(always)]
    fn array_header(&mut self, n: usize) {
        if n < 16 {
            self.put([0x90 | n as u8]);
        } else if let Ok(n) = u16::try_from(n) {
            let be = n.to_be_bytes();
            self.put([0xdc, be[0], be[1]]);
        } else {
            let be = (n as u32).to_be_bytes();
            self.put([0xdd, be[0], be[1], be[2], be[3]]);
        }
    }

    /// An unsigned integer in its shortest msgpack form (as msgspec writes it).
    #[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
    #[inline(always)]
    fn uint(&mut self, v: u64) {
        if let Ok(v) = u32::try_from(v) {
            let (word, len) = uint32_word(v);
            self.put_word(word, len);
        } else {
            let mut b = [0xcf; 9];
            b[1..].copy_from_slice(&v.to_be_bytes());
            self.put(b);
        }
    }

    fn int(&mut self, v: i64) {
        if let Ok(u) = u64::try_from(v) {
            self.uint(u);
        } else if v >= -32 {
            self.put([v as u8]);
        } else if let Ok(v) = i8::try_from(v) {
            self.put([0xd0, v as u8]);
        } else if let Ok(v) = i16::try_from(v) {
            let be = v.to_be_bytes();
            self.put([0xd1, be[0], be[1]]);
        } else if let Ok(v) = i32::try_from(v) {
            let be = v.to_be_bytes();
            self.put([0xd2, be[0], be[1], be[2], be[3]]);
        } else {
            let mut b = [0xd3; 9];
            b[1..].copy_from_slice(&v.to_be_bytes());
            self.put(b);
        }
    }

    /// A byte string as msgpack str when it is UTF-8 (vLLM's identifiers and salts are `str`),
    /// else as bin.
    fn text_or_bin(&mut self, b: &[u8]) {
        match std::str::from_utf8(b) {
            Ok(text) => self.string(text),
            Err(_) => self.bin(b),
        }
    }

    fn string(&mut self, s: &str) {
        let n = s.len();
        if n < 32 {
            self.put([0xa0 | n as u8]);
        } else if let Ok(n) = u8::try_from(n) {
            self.put([0xd9, n]);
        } else if let Ok(n) = u16::try_from(n) {
            let be = n.to_be_bytes();
            self.put([0xda, be[0], be[1]]);
        } else {
            let be = (n as u32).to_be_bytes();
            self.put([0xdb, be[0], be[1], be[2], be[3]]);
        }
        self.slice(s.as_bytes());
    }

    fn bin(&mut self, b: &[u8]) {
        let n = b.len();
        if let Ok(n) = u8::try_from(n) {
            self.put([0xc4, n]);
        } else if let Ok(n) = u16::try_from(n) {
            let be = n.to_be_bytes();
            self.put([0xc5, be[0], be[1]]);
        } else {
            let be = (n as u32).to_be_bytes();
            self.put([0xc6, be[0], be[1], be[2], be[3]]);
        }
        self.slice(b);
    }
}

/// A u32's shortest msgpack form as the low bytes of a little-endian word, and its length:
/// a positive fixint below 128, else the uint 8 / 16 / 32 tag and the value big-endian.
#[allow(clippy::inline_always)] // the writer's cursor stays in registers only when inlined
#[inline(always)]
fn uint32_word(v: u32) -> (u64, usize) {
    if v < 0x80 {
        (u64::from(v), 1)
    } else if v < 0x100 {
        (0xcc | u64::from(v) << 8, 2)
    } else if v < 0x1_0000 {
        (0xcd | u64::from((v as u16).swap_bytes()) << 8, 3)
    } else {
        (0xce | u64::from(v.swap_bytes()) << 8, 5)
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

    /// Digests 1 to `count`: all zero but byte `at`, which holds the digest's number.
    fn numbered_digests(count: u8, at: usize) -> Vec<Digest> {
        (1..=count)
            .map(|i| {
                let mut d = Digest([0; 32]);
                d.0[at] = i;
                d
            })
            .collect()
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
        let drained = log.drain_wire(1.5, Some(0), &mut out);
        assert_eq!((drained.taken, drained.written), (3, 3));
        assert_eq!(hex(&out[..drained.bytes]), VECTOR);
        assert_eq!(log.drain_wire(1.5, Some(0), &mut out), WireDrain::default());
    }

    /// A buffer written in place gives the bytes of a fresh one whatever it held and however
    /// long it was: shorter than the batch (it grows), as long, longer (left past the batch).
    #[test]
    fn in_place_batches_are_the_appended_ones() {
        let digests: Vec<Digest> = (1..=40u8)
            .map(|i| {
                let mut d = Digest([0; 32]);
                d.0[15] = i;
                d.0[8] = i.wrapping_mul(37);
                d
            })
            .collect();
        let tokens: Vec<u32> =
            (0..160u32).map(|i| [5, 200, 40_000, 3_000_000_000][i as usize % 4] + i).collect();
        let format = WireFormat {
            block_size: 4,
            unit: 4,
            digest_len: 16,
            kinds: vec![WireKind::FullAttention, WireKind::Mamba],
        };
        let mut log = EventLog::new(true, 64, format);
        let salted = ExtraKeys { cache_salt: Some(b"tenant".to_vec()), ..ExtraKeys::default() };
        for position in (4..=160).step_by(4) {
            log.stored_key(0, position / 4, position, false, &tokens, &digests, &salted);
            log.seal();
        }
        log.stored_key(1, 3, 8, true, &tokens, &digests, &ExtraKeys::default());
        let records = log.drain();
        let mut fresh = vec![0x55];
        let written = encode_batch(&records, log.format(), -2.5, Some(-40_000), &mut fresh);
        assert_eq!((fresh[0], written), (0x55, 41), "appended after what was there");
        let want = &fresh[1..];
        for len in [
            0,
            1,
            9,
            want.len() - 1,
            want.len(),
            want.len() + 7,
            want.len() + 15,
            want.len() + 16,
            9000,
        ] {
            let mut buf = vec![0xaa; len];
            let (size, n) =
                encode_batch_into(&records, log.format(), -2.5, Some(-40_000), &mut buf);
            assert_eq!((&buf[..size], n), (want, 41), "buffer of {len}");
            assert!(buf.len() >= len && buf[size..].iter().all(|&b| b == 0xaa || b == 0), "{len}");
        }
    }

    /// A batch past its size hint (extra keys, which the hint leaves out) measures exactly
    /// what a buffer large enough from the start holds: a store that did not fit in the first
    /// pass must not drop the room left, or the size counts that room as written and the
    /// batch carries trailing bytes (`fuzz_core`, seed 1796206065607800160). The reference is a
    /// single pass into a buffer that needs no second one; the image counts and hash lengths
    /// move the end of the hint across every store of the map.
    #[test]
    fn a_batch_past_its_size_hint_is_measured_exactly() {
        let digests = numbered_digests(4, 8);
        let format = WireFormat {
            block_size: 1,
            unit: 1,
            digest_len: 16,
            kinds: vec![WireKind::FullAttention],
        };
        let mut outgrown = 0;
        for (images, hash_len) in (0..12u32).flat_map(|n| (1..12usize).map(move |h| (n, h))) {
            let multimodal = (0..images)
                .map(|i| MultimodalInput { start: i % 4, end: 4, hash: vec![b'a'; hash_len] })
                .collect();
            // A run of four one-token blocks, as the manager records it.
            let records = vec![EventRecord {
                sequence: 8,
                event: CacheEvent::BlockStored {
                    group: 0,
                    block: 17,
                    blocks: vec![17, 18, 19, 20],
                    keys: digests.clone(),
                    parent: None,
                    token_start: 0,
                    token_end: 4,
                    checkpoint: false,
                    tokens: vec![0, 1, 2, 3],
                    tokens_start: 0,
                    wire_parent: None,
                    lora_id: None,
                    cache_salt: None,
                    multimodal,
                },
            }];
            let hint = 32 + records.iter().map(|r| size_hint(&r.event)).sum::<usize>();
            let mut roomy = vec![0xaa; 1 << 16];
            let (size, n) = encode_batch_into(&records, &format, 1.0, Some(0), &mut roomy);
            outgrown += usize::from(size > hint);
            assert_eq!((roomy[size - 1], n), (0, 1), "{images} x {hash_len}: the rank ends it");
            let want = hex(&roomy[..size]);
            let mut fresh = Vec::new();
            assert_eq!(encode_batch(&records, &format, 1.0, Some(0), &mut fresh), n);
            assert_eq!(hex(&fresh), want, "{images} x {hash_len}, appended");
            for len in [0, hint, size - 1] {
                let mut buf = vec![0x55; len];
                let (got, m) = encode_batch_into(&records, &format, 1.0, Some(0), &mut buf);
                assert_eq!(
                    (hex(&buf[..got]), m),
                    (want.clone(), n),
                    "{images} x {hash_len}, {len}"
                );
            }
        }
        assert!(outgrown > 60, "only {outgrown} batches outgrew their hint");
    }

    #[derive(Clone, Debug)]
    enum Op {
        Store { group: u32, units: u32, block: u32, checkpoint: bool, extra: u8 },
        Remove { group: u32, from: u32, keys: u32, held: u8 },
        Clear,
        Seal,
        DrainWire,
        Drain,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            6 => (0u32..2, 1u32..=12, 1u32..6, proptest::bool::weighted(0.2), 0u8..4).prop_map(
                |(group, units, block, checkpoint, extra)| Op::Store {
                    group,
                    units,
                    block,
                    checkpoint,
                    extra
                }
            ),
            2 => (0u32..2, 1u32..=12, 0u32..4, any::<u8>())
                .prop_map(|(group, from, keys, held)| Op::Remove { group, from, keys, held }),
            1 => Just(Op::Clear),
            2 => Just(Op::Seal),
            2 => Just(Op::DrainWire),
            1 => Just(Op::Drain),
        ]
    }

    proptest::proptest! {
        /// A log of bounded capacity drained to the wire, whose slots the next events reuse in
        /// place (a slot of another kind of event, a ring wrapped by drops at capacity), holds
        /// and encodes the last `capacity` events an unbounded log drained to records (every
        /// event new) holds, and counts the others as dropped.
        #[test]
        fn a_reused_ring_holds_what_a_fresh_log_holds(
            capacity in 1usize..7,
            wide in proptest::bool::ANY,
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let unit = 2;
            let format = WireFormat {
                block_size: if wide { 4 } else { 2 },
                unit,
                digest_len: 16,
                kinds: vec![WireKind::FullAttention, WireKind::Mamba],
            };
            let tokens: Vec<u32> = (0..24u32).map(|i| i * 40_000 + 3).collect();
            let hashes = numbered_digests(12, 15);
            let extras = [
                ExtraKeys::default(),
                ExtraKeys { cache_salt: Some(b"salt".to_vec()), ..ExtraKeys::default() },
                ExtraKeys { lora_id: Some(300), ..ExtraKeys::default() },
                ExtraKeys {
                    multimodal: vec![MultimodalInput { start: 3, end: 9, hash: b"img".to_vec() }],
                    ..ExtraKeys::default()
                },
            ];
            let mut fresh = EventLog::new(true, usize::MAX, format.clone());
            let mut dropped = 0;
            let last = |fresh: &mut EventLog, dropped: &mut u64| {
                let mut all = fresh.drain();
                let keep = all.len().min(capacity);
                *dropped += (all.len() - keep) as u64;
                all.drain(..all.len() - keep);
                all
            };
            let mut reused = EventLog::new(true, capacity, format);
            let mut buf = vec![0x11; 5];
            for op in ops {
                for log in [&mut fresh, &mut reused] {
                    match &op {
                        Op::Store { group, units, block, checkpoint, extra } => log.stored_key(
                            *group,
                            *block,
                            units * unit,
                            *checkpoint,
                            &tokens,
                            &hashes,
                            &extras[*extra as usize],
                        ),
                        Op::Remove { group, from, keys, held } => {
                            let lost: Vec<BlockKey> = (0..*keys)
                                .map(|k| BlockKey {
                                    key: crate::pool::Key {
                                        group: *group,
                                        digest: hashes[((from + k) % 12) as usize],
                                    },
                                    position: ((from + k) % 12 + 1) * unit,
                                })
                                .collect();
                            log.removed(*group, 1, &lost, |k| {
                                held >> (k.position / unit % 8) & 1 == 1
                            });
                        }
                        Op::Clear => log.push(CacheEvent::AllBlocksCleared),
                        Op::Seal => log.seal(),
                        Op::DrainWire | Op::Drain => {}
                    }
                }
                match op {
                    Op::DrainWire => {
                        let records = last(&mut fresh, &mut dropped);
                        let mut want = Vec::new();
                        let written = encode_batch(&records, fresh.format(), 0.5, Some(3), &mut want);
                        let got = reused.drain_wire(0.5, Some(3), &mut buf);
                        proptest::prop_assert_eq!((got.taken, got.written), (records.len(), written));
                        if records.is_empty() {
                            proptest::prop_assert_eq!(got.bytes, 0);
                        } else {
                            proptest::prop_assert_eq!(&buf[..got.bytes], want.as_slice());
                        }
                    }
                    Op::Drain => {
                        proptest::prop_assert_eq!(last(&mut fresh, &mut dropped), reused.drain());
                        proptest::prop_assert_eq!(reused.dropped(), dropped);
                    }
                    _ => {}
                }
            }
            proptest::prop_assert_eq!(last(&mut fresh, &mut dropped), reused.drain());
            proptest::prop_assert_eq!(reused.dropped(), dropped);
        }
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
        let digests = numbered_digests(8, 15);
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
