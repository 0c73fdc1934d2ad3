//! The one error type of the core.
//!
//! Every misuse reachable through the public API is a variant with structured fields and a
//! message that says what was wrong and what to change. Running out of blocks is not an error:
//! `schedule` returns `Ok(None)` for it.

use thiserror::Error;

/// Errors returned by [`crate::CacheManager`] and the configuration validators.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CacheError {
    /// The configuration is inconsistent; the message says which field to change.
    #[error("invalid configuration: {message}")]
    Config { message: String },

    /// A request argument is out of range or malformed (empty tokens, bad multimodal range, ...).
    #[error("invalid request: {message}")]
    InvalidRequest { message: String },

    /// The sequence id is not known (never added, or already finished).
    #[error("unknown sequence {seq_id}: add it first (finished sequences must be added again)")]
    UnknownSequence { seq_id: u64 },

    /// `add` of a sequence id that is still live.
    #[error("sequence {seq_id} is already live: finish or preempt it, or use another id")]
    DuplicateSequence { seq_id: u64 },

    /// `schedule` of a sequence whose every token is already computed.
    #[error(
        "sequence {seq_id} has nothing left to compute ({num_computed} of {num_tokens} tokens \
         computed): append the sampled token first"
    )]
    NothingToSchedule { seq_id: u64, num_computed: u32, num_tokens: u32 },

    /// A call that the step protocol does not allow now (plan in flight, double schedule, ...).
    #[error("step protocol: {message}")]
    Step { message: String },

    /// `commit` / `abort` of a plan that is not the one in flight.
    #[error(
        "plan of step {plan_step} is not in flight ({state}): commit or abort each plan exactly \
         once, the latest one built"
    )]
    StalePlan { plan_step: u64, state: String },

    /// A checkpoint position the kernel cannot write; `reason` says which rule it breaks (the
    /// backend's alignment, the hash unit, the chunk's range).
    #[error(
        "checkpoint at position {position} is offset {offset} from the chunk start {chunk_start}, \
         {reason}; {valid}"
    )]
    Alignment {
        position: u32,
        /// `position - chunk_start`: negative for a position before the chunk.
        offset: i64,
        alignment: u32,
        chunk_start: u32,
        reason: String,
        valid: String,
    },

    /// `reset` while sequences still hold blocks.
    #[error("reset refused: {live} sequence(s) still hold blocks; finish or preempt them first")]
    ResetRefused { live: usize },

    /// `check_invariants` found an inconsistency (a bug in the core; please report it).
    #[error("invariant violated: {message}")]
    Invariant { message: String },
}

impl CacheError {
    pub(crate) fn config(message: impl Into<String>) -> Self {
        Self::Config { message: message.into() }
    }
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidRequest { message: message.into() }
    }
    pub(crate) fn step(message: impl Into<String>) -> Self {
        Self::Step { message: message.into() }
    }
    pub(crate) fn invariant(message: impl Into<String>) -> Self {
        Self::Invariant { message: message.into() }
    }
}

/// Declares [`CacheError::kind`] and [`CacheError::KINDS`] from one list of the variants:
/// `kind`'s `match` has no wildcard, so a variant missing from the list does not compile, and
/// `KINDS` is that same list (the bindings map every entry of it to a Python class and test it).
macro_rules! error_kinds {
    ($($variant:ident),+ $(,)?) => {
        impl CacheError {
            /// The stable name of every variant (what [`CacheError::kind`] returns), in
            /// declaration order.
            pub const KINDS: &'static [&'static str] = &[$(stringify!($variant)),+];

            /// The stable name of the variant, one of [`CacheError::KINDS`].
            #[must_use]
            pub fn kind(&self) -> &'static str {
                match self {
                    $(Self::$variant { .. } => stringify!($variant),)+
                }
            }
        }
    };
}

error_kinds!(
    Config,
    InvalidRequest,
    UnknownSequence,
    DuplicateSequence,
    NothingToSchedule,
    Step,
    StalePlan,
    Alignment,
    ResetRefused,
    Invariant,
);

/// Result alias of the core.
pub type Result<T, E = CacheError> = std::result::Result<T, E>;
