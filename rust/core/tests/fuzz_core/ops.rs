//! The fuzz traffic: every call of the core's API with raw, wide arguments. Sequence ids come
//! from a small set (so calls collide with live, finished and never-added ids) plus the ends
//! of the `u64` range; budgets, lookaheads, positions and group ids include 0, the API's
//! bounds and `u32::MAX`; prompts share prefixes (a few base streams, or a known sequence's
//! tokens) and carry extra keys, some malformed. `Step` and `Decode` bundle an engine step so
//! that runs make progress between the single calls.

use proptest::prelude::*;

use crate::extra::{extra_op, ExtraOp};

/// A sequence id: `Small(i)` names one of a few ids (`i % 12`), `Known(i)` a live or finished
/// one if any, `Huge(i)` one of the last ids of the `u64` range, `Fresh` one never used.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Id {
    Fresh,
    Small(u8),
    Known(u8),
    Huge(u8),
}

/// A count or position: small, at a bound, or random.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Num {
    Small(u8),
    /// `MAX_LOOKAHEAD_TOKENS - 1 + i % 3` for lookaheads, the sequence's length around its end
    /// for positions.
    Bound(u8),
    Max,
    Any(u32),
}

#[derive(Clone, Debug)]
pub(crate) enum Plan {
    /// The plan in flight (or the latest built).
    Current,
    /// An older plan of this manager.
    Stale(u8),
    /// A plan another manager built.
    Foreign(u8),
    /// A step id with no plan: 0, `u64::MAX`, or the next one.
    Id(u8),
}

/// One request of an `AddBatch`: `Add`'s id, source, len, suffix, extends and extra keys.
pub(crate) type BatchAdd = (Id, u8, u8, u8, Option<Id>, ExtraOp);

#[derive(Clone, Debug)]
pub(crate) enum FuzzOp {
    Add {
        id: Id,
        /// `source % 3 == 0`: a base stream; else a known sequence's tokens.
        source: u8,
        len: u8,
        suffix: u8,
        extends: Option<Id>,
        extra: ExtraOp,
        /// Tokens at the top of the `u32` range instead of small ones.
        high_tokens: bool,
    },
    Lookup(Id),
    /// `add_batch` of these requests (`Add`'s fields but `high_tokens`), on `threads` threads
    /// (beyond `MAX_HASH_THREADS` sometimes).
    AddBatch {
        adds: Vec<BatchAdd>,
        threads: u8,
    },
    Schedule {
        id: Id,
        budget: Num,
        lookahead: Num,
        exact: bool,
    },
    /// `schedule_batch` of the picked ids (`repeat`: one of them twice).
    ScheduleBatch {
        ids: Vec<Id>,
        budget: Num,
        exact: bool,
        repeat: bool,
    },
    SuggestChunk {
        id: Id,
        budget: Num,
    },
    RequestCheckpoint {
        id: Id,
        position: Num,
    },
    /// `build_plan`, or `build_plan_into` a plan of this manager, a foreign one or a fresh one.
    BuildPlan {
        into: u8,
    },
    Commit {
        plan: Plan,
        /// `commit(&plan)` rather than `commit_step(id)`.
        by_plan: bool,
    },
    Abort {
        plan: Plan,
        by_plan: bool,
    },
    Append {
        id: Id,
        tokens: u8,
    },
    AppendBatch {
        ids: Vec<Id>,
        repeat: bool,
    },
    /// `decode_step`, committing the plan in flight first when `commit`.
    DecodeStep {
        commit: bool,
        everyone: bool,
    },
    Finish(Id),
    Preempt(Id),
    Reset,
    BlockTable {
        group: Num,
        ids: Vec<Id>,
    },
    /// Commit what is in flight, schedule every runnable sequence, maybe request a checkpoint,
    /// build, commit or abort.
    Step {
        budget: Num,
        exact: bool,
        request: Option<Num>,
        abort: bool,
    },
    /// Commit what is in flight, then `decode_step` or append + schedule + build + commit.
    Decode {
        rounds: u8,
        fused: bool,
    },
    /// A batch call (`schedule_batch`, `append_batch`, `decode_step`, `block_table`) of one id
    /// more than `MAX_BATCH_SEQUENCES`.
    OversizedBatch {
        call: u8,
    },
}

fn id() -> impl Strategy<Value = Id> {
    prop_oneof![
        4 => any::<u8>().prop_map(Id::Known),
        3 => any::<u8>().prop_map(Id::Small),
        1 => any::<u8>().prop_map(Id::Huge),
    ]
}

fn num() -> impl Strategy<Value = Num> {
    prop_oneof![
        6 => any::<u8>().prop_map(Num::Small),
        1 => any::<u8>().prop_map(Num::Bound),
        1 => Just(Num::Max),
        1 => any::<u32>().prop_map(Num::Any),
    ]
}

fn budget() -> impl Strategy<Value = Num> {
    prop_oneof![4 => any::<u8>().prop_map(Num::Small), 3 => Just(Num::Max), 1 => num()]
}

fn lookahead() -> impl Strategy<Value = Num> {
    prop_oneof![
        8 => Just(Num::Small(0)),
        2 => (0u8..=6).prop_map(Num::Small),
        1 => any::<u8>().prop_map(Num::Bound),
        1 => Just(Num::Max),
    ]
}

fn new_id() -> impl Strategy<Value = Id> {
    prop_oneof![5 => Just(Id::Fresh), 4 => id()]
}

fn plan() -> impl Strategy<Value = Plan> {
    prop_oneof![
        12 => Just(Plan::Current),
        2 => any::<u8>().prop_map(Plan::Stale),
        2 => any::<u8>().prop_map(Plan::Foreign),
        1 => any::<u8>().prop_map(Plan::Id),
    ]
}

fn extra() -> impl Strategy<Value = ExtraOp> {
    prop_oneof![1 => Just(ExtraOp::none()), 1 => extra_op()]
}

pub(crate) fn op() -> impl Strategy<Value = FuzzOp> {
    prop_oneof![
        10 => (new_id(), any::<u8>(), prop_oneof![3 => 1u8..=40, 1 => 41u8..=160], prop_oneof![2 => Just(0u8), 1 => 1u8..24],
               prop::option::of(id()), extra(), prop::bool::weighted(0.05))
            .prop_map(|(id, source, len, suffix, extends, extra, high_tokens)| FuzzOp::Add {
                id, source, len, suffix, extends, extra, high_tokens
            }),
        2 => (prop::collection::vec((new_id(), any::<u8>(), 1u8..=40, 0u8..8, prop::option::of(id()), extra()), 0..=5),
               prop_oneof![8 => 0u8..4, 1 => 64u8..=66])
            .prop_map(|(adds, threads)| FuzzOp::AddBatch { adds, threads }),
        3 => id().prop_map(FuzzOp::Lookup),
        6 => (id(), budget(), lookahead(), any::<bool>())
            .prop_map(|(id, budget, lookahead, exact)| FuzzOp::Schedule { id, budget, lookahead, exact }),
        3 => (prop::collection::vec(id(), 0..=6), budget(), any::<bool>(), prop::bool::weighted(0.1))
            .prop_map(|(ids, budget, exact, repeat)| FuzzOp::ScheduleBatch { ids, budget, exact, repeat }),
        2 => (id(), budget()).prop_map(|(id, budget)| FuzzOp::SuggestChunk { id, budget }),
        3 => (id(), num()).prop_map(|(id, position)| FuzzOp::RequestCheckpoint { id, position }),
        4 => any::<u8>().prop_map(|into| FuzzOp::BuildPlan { into }),
        5 => (plan(), any::<bool>()).prop_map(|(plan, by_plan)| FuzzOp::Commit { plan, by_plan }),
        2 => (plan(), any::<bool>()).prop_map(|(plan, by_plan)| FuzzOp::Abort { plan, by_plan }),
        3 => (id(), 1u8..=5).prop_map(|(id, tokens)| FuzzOp::Append { id, tokens }),
        2 => (prop::collection::vec(id(), 0..=6), prop::bool::weighted(0.1))
            .prop_map(|(ids, repeat)| FuzzOp::AppendBatch { ids, repeat }),
        3 => (any::<bool>(), prop::bool::weighted(0.1))
            .prop_map(|(commit, everyone)| FuzzOp::DecodeStep { commit, everyone }),
        4 => id().prop_map(FuzzOp::Finish),
        2 => id().prop_map(FuzzOp::Preempt),
        1 => Just(FuzzOp::Reset),
        1 => (num(), prop::collection::vec(id(), 0..=4))
            .prop_map(|(group, ids)| FuzzOp::BlockTable { group, ids }),
        16 => (budget(), any::<bool>(), prop::option::weighted(0.3, num()), prop::bool::weighted(0.1))
            .prop_map(|(budget, exact, request, abort)| FuzzOp::Step { budget, exact, request, abort }),
        10 => (1u8..=6, any::<bool>()).prop_map(|(rounds, fused)| FuzzOp::Decode { rounds, fused }),
        1 => any::<u8>().prop_map(|call| FuzzOp::OversizedBatch { call }),
    ]
}
