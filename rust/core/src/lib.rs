//! `prefixcache-core`: the whole prefix-cache engine, with no Python in its dependency graph.
//!
//! A [`CacheManager`] owns block pools, the chained prefix-hash index, eviction and checkpoint
//! planning for models that mix attention layers (paged KV blocks) with recurrent-state layers
//! (one state snapshot per block). Engines drive it through a two-phase step protocol:
//! `add` -> `lookup` -> `schedule` -> `build_plan` -> kernels -> `commit` | `abort`.
//!
//! Modules, bottom-up (no import circle; `tests/module_graph.rs` checks it): `limits`, `error`,
//! `hashing` (digests), `chains` (many chains across threads), `pool` (one pool's blocks,
//! reference counts, LRU), `index` (published keys), `events`, `stats`; `config` (configuration, the rules, the group layout); `store`
//! (pools + index + events: allocation, publication, eviction); `hit` (what a lookup returns,
//! and the hit rule over store, layout and a sequence's content); `sequence` (a sequence, its
//! phase, its per-group blocks and step); `table` (the sequence table and the finished cache);
//! `admission` and `checkpoints` (the blocks a chunk gets, the checkpoints it exports);
//! `manager` (the protocol's state and sequence calls); `batch` (`add_batch`); `schedule`,
//! `plan`, `commit` (the step's calls); `invariants`.
#![forbid(unsafe_code)]

mod admission;
mod batch;
mod chains;
mod checkpoints;
mod commit;
pub mod config;
pub mod error;
pub mod events;
pub mod hashing;
mod hit;
mod index;
mod invariants;
pub mod limits;
mod manager;
mod plan;
pub mod pool;
mod schedule;
mod sequence;
pub mod stats;
mod store;
mod table;

pub use batch::AddRequest;
pub use config::{
    aligned_geometry, is_exportable_offset, nearest_exportable_offsets, CacheConfig,
    CheckpointGrid, GroupConfig, GroupKind, PoolConfig, Retention, StateGroupConfig,
};
pub use error::{CacheError, Result};
pub use events::{CacheEvent, EventRecord, WireFormat, WireKind};
pub use hashing::{
    hash_prefix, Digest, ExtraKeys, HashAlgorithm, HashConfig, MultimodalInput, DEFAULT_SEED,
    ENCODING_VERSION,
};
pub use hit::{GroupHit, Hit, MissReason};
pub use manager::{Added, CacheManager, PoolUsage, MAX_SEQUENCE_TOKENS};
pub use plan::{PagedGroupPlan, StateGroupPlan, StepPlan};
pub use pool::{BlockId, NULL_BLOCK};
pub use schedule::Scheduled;
pub use stats::{GroupStats, SkipReason, Stats};
