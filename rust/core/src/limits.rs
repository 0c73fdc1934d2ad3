//! The bounds on every count the API takes, in one place.
//!
//! Each constant is checked where the value enters (configuration validation, `add`, `append`,
//! `schedule`, the batch calls); beyond it the caller gets `CacheError::Config` or
//! `CacheError::InvalidRequest` naming the limit, and the manager is unchanged. Allocations sized
//! by the caller below these bounds are reserved fallibly (`try_reserve`): a request the machine
//! cannot hold is refused with the bytes it would need, never an abort of the process.
//!
//! The README ("Limits") lists each bound with what it costs in memory.

/// The largest pool: block ids must fit the `i32` arrays handed to kernels.
pub const MAX_BLOCKS_PER_POOL: u32 = i32::MAX as u32;

/// Longest sequence accepted: positions and plan offsets are `i32` in the step plan.
pub const MAX_SEQUENCE_TOKENS: usize = i32::MAX as usize;

/// Most pools one configuration may name.
pub const MAX_POOLS: usize = 256;

/// Most groups one configuration may name (group ids are small integers in events and plans).
pub const MAX_GROUPS: usize = 256;

/// Largest hash unit U, in tokens (the hasher keeps a buffer of `4 U` bytes).
pub const MAX_HASH_UNIT: u32 = 1 << 20;

/// Largest paged block size B, in tokens (and sliding window W).
pub const MAX_BLOCK_SIZE: u32 = 1 << 24;

/// Most multimodal inputs one sequence may carry (each unit's digest scans them).
pub const MAX_MULTIMODAL_INPUTS: usize = 4096;

/// Longest cache salt or multimodal hash, in bytes (each enters the hash input of every unit it
/// touches: pass a digest of anything longer).
pub const MAX_EXTRA_KEY_BYTES: usize = 4096;

/// Most ids one batch call takes (`schedule_batch`, `append_batch`, `decode_step`,
/// `block_table`; the requests of one `add_batch`).
pub const MAX_BATCH_SEQUENCES: usize = 1 << 20;

/// Most threads one `add_batch` hashes its prompts on (the calling thread included).
pub const MAX_HASH_THREADS: usize = 64;

/// Most tokens one step may schedule in all (`query_start_loc` is `int32` in the plan): a
/// `schedule` is clamped to what is left of it, as it is to what its sequence has left.
pub const MAX_STEP_TOKENS: u32 = i32::MAX as u32;

/// Most speculative (lookahead) tokens one `schedule` may reserve blocks for.
pub const MAX_LOOKAHEAD_TOKENS: u32 = 1 << 16;

/// Most plans in flight at once (`CacheConfig::max_steps_in_flight`, D). A sequence in j
/// in-flight steps holds j + 1 running-state blocks per state group, so D bounds that too.
pub const MAX_STEPS_IN_FLIGHT: u32 = 8;

/// Most keys remembered as recently evicted (`CacheConfig::recently_evicted_capacity`).
pub const MAX_RECENTLY_EVICTED: usize = 1 << 24;

/// Most events kept undrained (`CacheConfig::max_pending_events`).
pub const MAX_PENDING_EVENTS: usize = 1 << 24;

/// Memory of one block's bookkeeping in a pool, reserved when the manager is built: its 64-byte
/// record, its (usually empty) spilled key list, its place on the free stack and its checkpoint
/// group tag. The hash index reserves 16 bytes a block more, for at most `2^21` blocks in all,
/// and grows with the keys actually published beyond that.
pub const BYTES_PER_BLOCK: usize = 64 + 24 + 4 + 1;

/// An empty `Vec<T>` with room for `len` elements, reserved fallibly: the error names what was
/// being allocated and the bytes it needed.
pub(crate) fn try_vec<T>(len: usize, what: &str) -> Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        format!(
            "{what} needs {} of memory, which could not be allocated",
            human_bytes(len.saturating_mul(std::mem::size_of::<T>()))
        )
    })?;
    Ok(v)
}

/// `bytes` as a short human-readable size (`1.5 GiB`).
#[must_use]
#[allow(clippy::cast_precision_loss)] // one decimal of a message: precision is not needed
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
