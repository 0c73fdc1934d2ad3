//! The random traffic: protocol calls with abstract arguments (which sequence, which budget)
//! that the driver resolves against the current state, so a shrunk sequence still means
//! something. `Step` and `Decode` bundle the calls of one engine step, so that runs make
//! progress; the single calls interleave in every other order, misuse included, and `Hostile`
//! calls pass values at or beyond the API's bounds.

use proptest::prelude::*;

use crate::extra::{extra_op, ExtraOp};

/// Longest prompt prefix taken from a base stream or a known sequence.
pub(crate) const MAX_PROMPT: u8 = 72;

/// A prompt: a prefix of a base stream (`source % 4 == 0`) or of a known sequence, plus
/// `suffix` fresh tokens, with extra keys (fresh, or the known sequence's changed a little);
/// `extends` names a known sequence, `reuse` re-adds a known id; `twin` adds the same prompt a
/// second time (a concurrent identical request).
#[derive(Clone, Debug)]
pub(crate) struct AddOp {
    pub source: u8,
    pub len: u8,
    pub suffix: u8,
    pub extends: Option<u8>,
    pub reuse: Option<u8>,
    pub twin: bool,
    pub extra: ExtraOp,
}

/// Values at or beyond the API's bounds; each must be refused with a typed error (or, for a
/// lookahead at the bound, `None` for want of blocks) and change nothing.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Hostile {
    /// `schedule` with `MAX_LOOKAHEAD_TOKENS + 1` lookahead tokens.
    LookaheadBeyondLimit,
    /// `schedule` with `u32::MAX` lookahead tokens.
    LookaheadMax,
    /// `schedule` with exactly `MAX_LOOKAHEAD_TOKENS` (allowed; no pool here can hold it).
    LookaheadAtLimit,
    /// `request_checkpoint` past the sequence's end: `u32::MAX`, or one token past it.
    CheckpointPastEnd,
    CheckpointMax,
    /// An `add` under a sequence id near `u64::MAX`.
    HugeId,
    /// `lookup`, `finish` and `num_computed` of `u64::MAX` (never added unless `HugeId` did).
    UnknownHugeId,
    /// `commit_step(0)` and `abort_step(u64::MAX)`.
    PlanIdsAtBounds,
    /// `block_table` of a group that does not exist, and of an unknown sequence.
    BlockTableBounds,
    /// `schedule_batch` and `append_batch` whose arrays differ in length.
    BatchLengths,
}

#[derive(Clone, Debug)]
pub(crate) enum Op {
    Add(AddOp),
    /// `add_batch` of these requests (`model/batch.rs`), on `threads` threads.
    AddBatch {
        adds: Vec<AddOp>,
        threads: u8,
    },
    Lookup {
        pick: u8,
    },
    Schedule {
        pick: u8,
        budget: u32,
        exact: bool,
        lookahead: u32,
    },
    /// `schedule_batch` of every runnable sequence, or of every live one (errors included).
    ScheduleBatch {
        budget: u32,
        exact: bool,
        everyone: bool,
    },
    /// `suggest_chunk`, then `schedule` of what it suggested.
    ScheduleSuggested {
        pick: u8,
        budget: u32,
    },
    RequestCheckpoint {
        pick: u8,
        position: u8,
    },
    BuildPlan,
    /// `which` mostly names the latest plan, sometimes an older or a future one.
    Commit {
        which: u8,
    },
    Abort {
        which: u8,
    },
    Append {
        pick: u8,
        len: u8,
    },
    Finish {
        pick: u8,
    },
    Preempt {
        pick: u8,
    },
    Reset,
    /// One engine step: schedule every runnable sequence, maybe request a checkpoint, build,
    /// commit (or abort).
    Step {
        budget: u32,
        exact: bool,
        request: Option<u8>,
        abort: bool,
    },
    /// `rounds` times: `len` sampled tokens for every sequence whose prompt is computed, then a
    /// step.
    Decode {
        len: u8,
        budget: u32,
        rounds: u8,
    },
    Hostile {
        what: Hostile,
        pick: u8,
    },
}

fn budget() -> impl Strategy<Value = u32> {
    prop_oneof![3 => 0u32..=12, 2 => 13u32..=40, 3 => Just(u32::MAX)]
}

fn add(extra_keys: bool) -> impl Strategy<Value = Op> {
    let extra = if extra_keys {
        prop_oneof![1 => Just(ExtraOp::none()), 2 => extra_op()].boxed()
    } else {
        Just(ExtraOp::none()).boxed()
    };
    (
        any::<u8>(),
        1..=MAX_PROMPT,
        prop_oneof![2 => Just(0u8), 1 => 1u8..12],
        prop::option::of(any::<u8>()),
        prop::option::weighted(0.2, any::<u8>()),
        prop::bool::weighted(0.25),
        extra,
    )
        .prop_map(|(source, len, suffix, extends, reuse, twin, extra)| {
            Op::Add(AddOp { source, len, suffix, extends, reuse, twin, extra })
        })
}

fn add_batch(extra_keys: bool) -> impl Strategy<Value = Op> {
    (prop::collection::vec(add(extra_keys), 0..6), 0u8..4).prop_map(|(ops, threads)| {
        let adds = ops
            .into_iter()
            .filter_map(|op| match op {
                Op::Add(add) => Some(add),
                _ => None,
            })
            .collect();
        Op::AddBatch { adds, threads }
    })
}

fn hostile() -> impl Strategy<Value = Op> {
    let what = prop_oneof![
        Just(Hostile::LookaheadBeyondLimit),
        Just(Hostile::LookaheadMax),
        Just(Hostile::LookaheadAtLimit),
        Just(Hostile::CheckpointPastEnd),
        Just(Hostile::CheckpointMax),
        Just(Hostile::HugeId),
        Just(Hostile::UnknownHugeId),
        Just(Hostile::PlanIdsAtBounds),
        Just(Hostile::BlockTableBounds),
        Just(Hostile::BatchLengths),
    ];
    (what, any::<u8>()).prop_map(|(what, pick)| Op::Hostile { what, pick })
}

fn schedule() -> impl Strategy<Value = Op> {
    (any::<u8>(), budget(), any::<bool>(), prop_oneof![4 => Just(0u32), 1 => 1u32..=5]).prop_map(
        |(pick, budget, exact, lookahead)| Op::Schedule { pick, budget, exact, lookahead },
    )
}

fn step() -> impl Strategy<Value = Op> {
    (budget(), any::<bool>(), prop::option::weighted(0.3, any::<u8>()), prop::bool::weighted(0.15))
        .prop_map(|(budget, exact, request, abort)| Op::Step { budget, exact, request, abort })
}

/// One call of the traffic; `extra_keys` adds salts, adapters and multimodal inputs to the
/// prompts and hostile values to the calls.
pub(crate) fn op(extra_keys: bool) -> BoxedStrategy<Op> {
    let calls = prop_oneof![
        10 => add(extra_keys),
        1 => add_batch(extra_keys),
        2 => any::<u8>().prop_map(|pick| Op::Lookup { pick }),
        8 => schedule(),
        3 => (budget(), any::<bool>(), prop::bool::weighted(0.2))
            .prop_map(|(budget, exact, everyone)| Op::ScheduleBatch { budget, exact, everyone }),
        3 => (any::<u8>(), budget())
            .prop_map(|(pick, budget)| Op::ScheduleSuggested { pick, budget }),
        4 => (any::<u8>(), any::<u8>())
            .prop_map(|(pick, position)| Op::RequestCheckpoint { pick, position }),
        5 => Just(Op::BuildPlan),
        5 => any::<u8>().prop_map(|which| Op::Commit { which }),
        2 => any::<u8>().prop_map(|which| Op::Abort { which }),
        3 => (any::<u8>(), 1u8..=3).prop_map(|(pick, len)| Op::Append { pick, len }),
        5 => any::<u8>().prop_map(|pick| Op::Finish { pick }),
        2 => any::<u8>().prop_map(|pick| Op::Preempt { pick }),
        1 => Just(Op::Reset),
        20 => step(),
        10 => (prop_oneof![2 => Just(1u8), 1 => 2u8..=3], budget(), 1u8..=4)
            .prop_map(|(len, budget, rounds)| Op::Decode { len, budget, rounds }),
    ];
    if extra_keys {
        prop_oneof![40 => calls, 1 => hostile()].boxed()
    } else {
        calls.boxed()
    }
}

/// The traffic of the properties that predate extra keys (plain prompts, no hostile values).
pub(crate) fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(false), 1..=60)
}

/// Traffic with extra keys and hostile values.
pub(crate) fn ops_with_extra_keys() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(true), 1..=60)
}
