//! Block events for external indexers (KV-aware routers): what became reachable, what stopped
//! being reachable, with monotone sequence numbers, drained by the caller.

use std::collections::VecDeque;

use crate::hashing::Digest;
use crate::pool::BlockId;

/// One change of what the cache can serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A block gained keys at a commit (or a decode-tail checkpoint at `finish`).
    BlockStored {
        group: u32,
        block: BlockId,
        /// The keys added in this commit, in position order.
        keys: Vec<Digest>,
        /// The key just before the first added one (`None` at the start of the sequence).
        parent: Option<Digest>,
        /// Tokens `[token_start, token_end)` the added keys cover.
        token_start: u32,
        token_end: u32,
        /// Whether the block is a recurrent-state checkpoint.
        checkpoint: bool,
    },
    /// A block lost every key (evicted for reuse).
    BlockRemoved { group: u32, block: BlockId, keys: Vec<Digest> },
    /// `reset` dropped everything.
    AllBlocksCleared,
}

/// An event with its sequence number (strictly increasing, never reused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRecord {
    pub sequence: u64,
    pub event: CacheEvent,
}

/// A bounded queue of events.
#[derive(Clone, Debug)]
pub struct EventLog {
    enabled: bool,
    capacity: usize,
    next_sequence: u64,
    dropped: u64,
    pending: VecDeque<EventRecord>,
}

impl EventLog {
    #[must_use]
    pub fn new(enabled: bool, capacity: usize) -> Self {
        Self { enabled, capacity, next_sequence: 0, dropped: 0, pending: VecDeque::new() }
    }

    #[must_use]
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn push(&mut self, event: CacheEvent) {
        if !self.enabled {
            return;
        }
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        if self.pending.len() >= self.capacity.max(1) {
            self.pending.pop_front();
            self.dropped += 1;
        }
        self.pending.push_back(EventRecord { sequence, event });
    }

    /// Takes every pending event, oldest first.
    pub fn drain(&mut self) -> Vec<EventRecord> {
        self.pending.drain(..).collect()
    }

    /// Events dropped because nobody drained them in time.
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}
