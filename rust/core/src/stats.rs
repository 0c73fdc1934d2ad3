//! Counters a user reads to see what the cache is doing and whether a policy pays for itself.

/// Why a retained checkpoint position was not exported.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum SkipReason {
    /// Interior position not on the kernel's grid (only with `exact` chunks).
    Unaligned,
    /// More interior positions than the backend writes per step (C).
    Capacity,
    /// A checkpoint at that position is already published for this prefix.
    AlreadyCached,
    /// No block could be spared (checkpoint cap, reserve for running sequences, empty pool).
    Budget,
    /// A unit boundary strictly inside a multi-token decode step.
    MidStep,
}

impl SkipReason {
    pub const ALL: [Self; 5] =
        [Self::Unaligned, Self::Capacity, Self::AlreadyCached, Self::Budget, Self::MidStep];

    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Unaligned => "unaligned",
            Self::Capacity => "capacity",
            Self::AlreadyCached => "already_cached",
            Self::Budget => "budget",
            Self::MidStep => "mid_step",
        }
    }

    #[must_use]
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Per-group counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Tokens of reconciled hits this group served (first schedules).
    pub hit_tokens: u64,
    /// Blocks of this group evicted for reuse.
    pub evictions: u64,
    /// State groups: checkpoints published (decode tails included).
    pub checkpoints_published: u64,
    /// State groups: retained positions not exported, by [`SkipReason::index`].
    pub checkpoints_skipped: [u64; 5],
    /// State groups: schedules that resumed from a published checkpoint.
    pub checkpoint_hits: u64,
    /// State groups: decode-tail snapshots published by `finish`.
    pub decode_tails_published: u64,
    /// Admissions whose own hit in this group stopped short of the prompt, by the reason
    /// (`MissReason::index`: not cached, recently evicted, no state at position, window gap).
    pub misses: [u64; 4],
}

/// Manager-wide counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub lookups: u64,
    /// Sum of reconciled hit lengths over lookups.
    pub lookup_hit_tokens: u64,
    /// First schedules (admissions).
    pub admissions: u64,
    /// Sum of the hits used by admissions.
    pub admitted_hit_tokens: u64,
    /// Sum of the prompt tokens of admissions (the tokens whose prefix was looked for: vLLM's
    /// prefix-cache queries).
    pub admitted_tokens: u64,
    pub scheduled_tokens: u64,
    /// `schedule` calls that returned `None` (the pool could not supply the sequence's blocks).
    pub refused_schedules: u64,
    /// Copy-on-write copies planned.
    pub copies: u64,
    pub commits: u64,
    pub aborts: u64,
    pub evictions: u64,
    pub events_dropped: u64,
    pub groups: Vec<GroupStats>,
}
