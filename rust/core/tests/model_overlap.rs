//! Model-based property test of overlapped steps: D = `max_steps_in_flight` in 1..=3, random
//! traffic of add (fresh prompts and forks of live ones), lookup, schedule (continuations
//! included), `build_plan`, commit and abort of the oldest plan and of later or stale ones,
//! placeholders appended and resolved, known appends, finish and preempt with steps in flight,
//! against a deliberately naive model; with a state group, its checkpoints too.
//!
//! The model keeps, per sequence, its known tokens, its extra keys, its placeholders (with the
//! plan built last when each batch of them was appended), its committed position and its steps
//! (plan, start, end), and the set of published prefixes, each as its identity (`key`): the
//! salt, the adapter, and per unit its tokens and the hashes of the multimodal inputs
//! overlapping it (section 2), so that two prefixes share a key exactly when those are equal,
//! whatever `extends`, a live prefix or a finished turn lets the core reuse. Prompts carry
//! salts, adapters and multimodal inputs (forks change them; a list out of order is refused
//! and adds nothing); the expected digests come from `hash_prefix` of the whole sequence.
//! Its rules, stated independently of the code:
//! - plans end in build order; at D = 1 no call but add, lookup, commit and abort is allowed
//!   while a plan is in flight; at D > 1 `build_plan` is refused with D plans in flight and a
//!   sequence with D steps cannot be scheduled again;
//! - a first schedule starts at the sequence's hit, a later one at the end of its newest step;
//! - a unit boundary q of a sequence becomes a published prefix when the step that computed
//!   token q - 1 committed and its first q tokens are known, whichever is last (a first step
//!   whose hit ends inside a block also re-keys the copied boundaries of that block);
//! - the hit is the longest published prefix of the known tokens below their end, in units;
//!   the pending hit also counts the boundaries in-flight steps will publish (their prefix
//!   known now), and waits for the latest plan among those that publish one it needs;
//! - aborting the oldest plan ends them all, undoes every step they hold (and the next-plan
//!   steps of the sequences they touched), drops the placeholders appended since it was built,
//!   and returns the ids of every plan it ended;
//! - finish or preempt with steps in flight releases the blocks once the last of them ends.
//!
//! The full-attention pool (small ones run short; `fa_blocks`), stated on its own: a started
//! sequence holds its table (`ceil(planned / B)` blocks: its hit's, then its own, appended by
//! the plans), a built first step resuming inside a block also the copy-on-write source until
//! its plan ends, and a scheduled first step pins, before allocating, a cached block for each
//! key of its hit no block in use serves (a hit uses a copy in use when there is one). A
//! schedule whose pins and new blocks exceed what is free or cached is refused (`None`). A key
//! is published into the block of the table holding token q - 1. An abort gives the undone
//! steps' blocks back (the tables as before the oldest plan); a sequence released after its
//! last step its whole table. Only a block not in use may be evicted, with exactly the keys it
//! carries, a key leaving the index when no block carries it any more; the pool's owned and
//! cached counts must be the model's (not checked while a scheduled step pins one of several
//! copies of a key that the model cannot name). A schedule evicts exactly the blocks it needs
//! beyond the free ones, and the least recently used first. The LRU order, stated on its own
//! (`sync_fa_lru`): a published block enters the LRU as its most recent entry when its last
//! holder lets go (a table released, a copy-on-write source at its plan's end, the hit pins
//! of a schedule dropped by finish or preempt or undone by an abort), a pin takes it out; a
//! sequence releases its table tail first; blocks released in one call in an order no rule
//! states are ties (neither may be evicted before the other is checked). Which copy of a key a
//! first schedule pins follows from it: the only one, else the one in use, else the most
//! recently used (checked against the plan's table).
//!
//! A sliding-window group (W tokens; `prop_overlapped_sliding_windows_follow_the_model`, in a
//! pool of its own, in two cases of five small enough to run short), stated on its own: resuming at L needs the blocks
//! covering `[max(0, L - W), L)`, so the hit is the largest candidate within the
//! full-attention bound that the window and the state group both allow, the window's own
//! hit stops `not_cached` when its key at the largest candidate is missing or full attention
//! bounds it, else `window_gap`; a first step's window table is nulls before
//! `max(0, L - W) / B`, the hit's blocks, a copy on write inside a block, then its own; at each
//! commit the blocks whose tokens all lie before the last W computed ones are released; an
//! engine applying every plan's appended and replaced entries holds the table; a key waiting
//! for its tokens whose window block was released meanwhile is never published. Its pool: a
//! started sequence holds its table's entries, a built first step its copy source, a scheduled
//! first step pins a cached block for each key of its window's hit no copy in use serves;
//! blocks carrying keys and held by nothing are cached, the rest free; a schedule whose pins
//! and new blocks (`ceil(end / B)` less its table) exceed free and cached is refused (`None`),
//! otherwise it takes free blocks first and evicts exactly the rest, each cached, with exactly
//! its keys, never the last copy of a key a scheduled step pinned (the pool's free and cached
//! counts are checked after every call; the eviction order is not stated).
//!
//! With a state group, each step must read the running state the step before it writes, and
//! write a buffer none of its other steps uses. Its checkpoints, stated on their own:
//! - which positions a step asks for: a prefill chunk `(qs, qe]` (a first step, or one that
//!   starts before the tokens known at the first schedule, placeholders counted, end) keeps the
//!   tail (the last unit boundary below that length), the junction of the first schedule's hit
//!   and every multiple of the interval, in that order (intervals latest first); a decode step
//!   keeps only its end when that is a unit boundary (the decode tail), and every boundary
//!   strictly inside it is skipped `mid_step`. Positions `request_checkpoint` asked for (unit
//!   boundaries of the chunk, asked between schedule and the plan, for a continuation too)
//!   come first in either case (a requested decode-step end is a checkpoint, not a decode
//!   tail, and a requested interior boundary is not skipped `mid_step`); any other position
//!   is an `Alignment` error. A position whose prefix is known and already has
//!   a checkpoint is skipped `already_cached`; past C interior ones (below qe), `capacity`;
//! - each kept position takes a block, no more of them per row than the state pool has free
//!   or cached (`budget`), and none that would leave the pool no more than the reserve of the
//!   started sequences (the state group's reserve, plus one per further step in flight and
//!   state group, each; `budget`); at the cap (checkpoint blocks of the group: published, planned, waiting for
//!   their tokens, private decode tails) it evicts the least recently used unpinned published
//!   checkpoint (a decode tail only a published decode tail), or is skipped `budget` when
//!   there is none; below it a free block first, else the pool's least recently used cached
//!   one;
//! - running buffers: a first schedule takes a pair, a continuation one more unless it holds a
//!   buffer neither its committed state nor any of its steps uses; the extras go back when it
//!   has no step left. A schedule the state pool cannot supply (the pair, and the checkpoint it
//!   resumes from when that one is cached) is refused (`None`) and changes nothing;
//! - at commit the checkpoint the first step resumed from is released (most recently used),
//!   then the step's checkpoints in ascending position: a decode tail replaces the sequence's
//!   private one, a checkpoint whose prefix is known is published (most recently used), one
//!   over a placeholder waits and is published by the `resolve` that makes its prefix known;
//!   abort frees what the steps planned and releases the resume checkpoints (most recently used);
//! - finish publishes the private decode tail when its prefix is known, at the least recently
//!   used end; preempt and finish drop the checkpoints still waiting for tokens;
//! - the state group's hit is a checkpoint at exactly L (or L = 0) within the full-attention
//!   bound; a first schedule resuming at L > 0 pins a copy of it: one already in use if there
//!   is one, else the most recently released (ties to the lowest id); the reconciled hit is the
//!   state group's, and the junction is the full-attention bound when it exceeds the hit by two
//!   units or more (at D > 1 the bound counts in-flight keys). The pending hit counts the
//!   checkpoints in-flight steps will publish (their prefix known; not decode tails), and waits
//!   for the latest plan among those publishing a key it needs: the block boundaries up to L, L,
//!   and the state at L.
//!
//! After every call: `check_invariants`, every live sequence's whole hit and pending hit,
//! positions, lengths and placeholders, the plans in flight, the `BlockStored` and
//! `BlockRemoved` events of the call, and with a state group the checkpoint blocks, the cached
//! (unpinned) ones, the blocks free or cached, and the checkpoint statistics; at the end
//! everything is committed and finished and no block may stay owned.
//!
//! Two state groups sharing the state pool, each with its own reserve and alignment (1, 2 or
//! U) and, in half the cases, its own retention, cap and C
//! (`prop_overlapped_shared_state_pool_follows_the_model`), stated on their own: one id space
//! and one LRU for both groups' running buffers and checkpoints; each group has its own
//! running buffers (a pair, and one more per continuation without a spare, in each), its
//! checkpoints (planned group after group, each taking what the pool has left), its cap (its
//! own checkpoints count, and beyond it it evicts only its own least recently used one), its
//! resume checkpoint (every group's pinned before any block is taken) and its statistics; a
//! hit needs a checkpoint at L in every state group; a commit releases and publishes group by
//! group; a chunk that does not reach the sequence's end ends on the least common multiple of
//! the alignments (trimmed to nothing, it schedules 0 tokens, takes nothing and is never
//! refused), a requested interior position must lie on that grid from the chunk's start, and
//! an interior position off a group's alignment from the chunk's start is skipped
//! `unaligned`; a checkpoint of either group keeps both groups' reserves: per started sequence, the
//! group's own `reserve_per_sequence` and one more block per further step in flight for each
//! state group of the pool, whichever group promised it.
//!
//! Cases: 256, and half as many with a sliding window and with a shared state pool
//! (`PROPTEST_CASES` or `MODEL_CASES` for more); `MODEL_PATHS=1` prints how often the fixed sample of
//! `overlapped_traffic_reaches_every_path` took each path.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use prefixcache_core::{
    hash_prefix, CacheConfig, CacheError, CacheEvent, CacheManager, Digest, ExtraKeys, GroupConfig,
    GroupHit, GroupKind, HashConfig, Hit, MissReason, MultimodalInput, PoolConfig, Retention,
    StateGroupConfig,
};
use proptest::prelude::*;

const U: u32 = 4;
/// The state group's index (and its pool's).
const STATE: u32 = 1;
/// Skip reasons, by `SkipReason::index`.
const UNALIGNED: usize = 0;
const CAPACITY: usize = 1;
const ALREADY_CACHED: usize = 2;
const BUDGET: usize = 3;
const MID_STEP: usize = 4;

#[derive(Clone, Debug)]
struct Setup {
    depth: u32,
    block: u32,
    /// Ids of the full-attention pool (the null block included): small ones evict.
    fa_blocks: u32,
    state: Option<StateSetup>,
    /// Whether every waiting sequence is looked up after every call (else only by `Lookup`).
    watch: bool,
    /// A sliding-window group (block size, window W), in a pool of its own
    /// (`prop_overlapped_sliding_windows_follow_the_model`) of `sw_blocks` ids (the null
    /// block included): small ones run short.
    window: Option<(u32, u32)>,
    sw_blocks: u32,
    /// State groups (one, or two sharing the state pool:
    /// `prop_overlapped_shared_state_pool_follows_the_model`).
    states: u32,
    /// The second state group's retention, cap and C, when they differ from the first's (its
    /// pool and reserve are `state`'s).
    second: Option<StateSetup>,
}

/// The state group's retention, cap and C (alignment 1: every interior offset is exportable).
#[derive(Clone, Debug)]
struct StateSetup {
    tail: bool,
    junction: bool,
    decode_tail: bool,
    interval: Option<u32>,
    cap: Option<u32>,
    per_step: Option<u32>,
    /// Ids of the state pool (the null block included): small ones run out.
    blocks: u32,
    /// The kernel's checkpoint alignment A (1 but in the shared state pool).
    alignment: u32,
    /// Each state group's `reserve_per_sequence` (the first alone with one group; two by
    /// default, different ones in the shared state pool).
    reserves: [u32; 2],
}

#[derive(Clone, Debug)]
enum Op {
    /// A prompt of a stream, with extra keys from `extra` (`Extras::of`; streams 2 and 3).
    Add {
        stream: u8,
        len: u8,
        extra: u8,
    },
    /// A new prompt: the first tokens of a live sequence's known ones, then fresh ones, then
    /// `unknown` placeholders (tokens still being sampled when it is admitted); its extra keys
    /// are the parent's (those within its tokens), changed by `change` (salt, adapter, a
    /// multimodal input's hash, an input inserted); `extends` names the parent.
    Fork {
        pick: u8,
        cut: u8,
        fresh: u8,
        unknown: u8,
        change: u8,
        extends: bool,
    },
    Lookup {
        pick: u8,
    },
    Schedule {
        pick: u8,
        budget: u8,
    },
    Build,
    /// 0: the oldest; 1: a later one; 2: a stale one.
    Commit {
        which: u8,
    },
    Abort {
        which: u8,
    },
    Placeholders {
        pick: u8,
        count: u8,
    },
    Resolve {
        pick: u8,
        count: u8,
    },
    Append {
        pick: u8,
        count: u8,
    },
    Finish {
        pick: u8,
    },
    Preempt {
        pick: u8,
    },
    /// An overlapped decode round: commit the oldest plan when D are in flight, resolve one
    /// placeholder of each started sequence that has one, then one placeholder and one token
    /// each (a prefill chunk for those still computing their prompt).
    Round,
    /// The same round through `decode_step_overlapped` (one call; at D > 1 only, for the
    /// sequences that are decoding).
    FastRound,
    /// A conversation's next turn: a sequence's steps in flight commit, it finishes, and its
    /// known tokens and more are added.
    Turn {
        pick: u8,
        fresh: u8,
    },
    /// Several rounds (decode long enough to cross unit boundaries).
    Decode {
        rounds: u8,
    },
    /// `request_checkpoint` for a sequence scheduled for the next plan (`pick` among those;
    /// when none is, a live one, scheduled first unless `position % 8 == 0`): below 200, a position the chunk accepts, else an arbitrary
    /// one (off the grid, outside the chunk).
    Request {
        pick: u8,
        position: u8,
    },
    /// Windowed traffic only: `count` placeholders appended to a sequence and scheduled in one
    /// chunk, planned and committed, the tokens still unknown (keys wait for them while the
    /// window may release their blocks).
    Ahead {
        pick: u8,
        count: u8,
    },
}

/// `op()`, and in the sliding-window property runs of placeholders computed ahead.
fn windowed_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => op(),
        1 => (any::<u8>(), 4u8..12).prop_map(|(pick, count)| Op::Ahead { pick, count }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..4, 1u8..24, any::<u8>())
            .prop_map(|(stream, len, extra)| Op::Add { stream, len, extra }),
        2 => (
            (any::<u8>(), any::<u8>(), 0u8..6),
            (prop::sample::select(vec![0u8, 0, 1, 2, 3, 4]), any::<u8>(), any::<bool>())
        )
            .prop_map(|((pick, cut, fresh), (unknown, change, extends))| Op::Fork {
                pick,
                cut,
                fresh,
                unknown,
                change,
                extends,
            }),
        2 => any::<u8>().prop_map(|pick| Op::Lookup { pick }),
        5 => (any::<u8>(), 1u8..12).prop_map(|(pick, budget)| Op::Schedule { pick, budget }),
        4 => Just(Op::Build),
        4 => (0u8..3).prop_map(|which| Op::Commit { which }),
        1 => (0u8..3).prop_map(|which| Op::Abort { which }),
        2 => (any::<u8>(), 1u8..3).prop_map(|(pick, count)| Op::Placeholders { pick, count }),
        2 => (any::<u8>(), 1u8..3).prop_map(|(pick, count)| Op::Resolve { pick, count }),
        1 => (any::<u8>(), 1u8..3).prop_map(|(pick, count)| Op::Append { pick, count }),
        2 => any::<u8>().prop_map(|pick| Op::Finish { pick }),
        1 => any::<u8>().prop_map(|pick| Op::Preempt { pick }),
        3 => Just(Op::Round),
        2 => Just(Op::FastRound),
        1 => (any::<u8>(), 1u8..6).prop_map(|(pick, fresh)| Op::Turn { pick, fresh }),
        1 => (2u8..9).prop_map(|rounds| Op::Decode { rounds }),
        3 => (any::<u8>(), any::<u8>()).prop_map(|(pick, position)| Op::Request { pick, position }),
    ]
}

fn state_setup() -> impl Strategy<Value = Option<StateSetup>> {
    let retained = (
        any::<[bool; 3]>(),
        prop::sample::select(vec![None, Some(U), Some(2 * U)]),
        prop::sample::select(vec![None, None, Some(2), Some(3), Some(5)]),
        prop::sample::select(vec![None, None, Some(1)]),
        prop::sample::select(vec![1024u32, 1024, 20, 48]),
    )
        .prop_map(|([tail, junction, decode_tail], interval, cap, per_step, blocks)| {
            let (reserves, alignment) = ([2, 2], 1);
            Some(StateSetup {
                tail,
                junction,
                decode_tail,
                interval,
                cap,
                per_step,
                blocks,
                alignment,
                reserves,
            })
        });
    prop_oneof![1 => Just(None), 3 => retained]
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        1u32..=3,
        prop::sample::select(vec![4u32, 8]),
        prop::sample::select(vec![1024u32, 1024, 14, 24, 40]),
        state_setup(),
        any::<bool>(),
    )
        .prop_map(|(depth, block, fa_blocks, state, watch)| Setup {
            depth,
            block,
            fa_blocks,
            state,
            watch,
            window: None,
            sw_blocks: 1024,
            states: 1,
            second: None,
        })
}

/// `setup()` with two state groups in the one state pool (their running buffers and
/// checkpoints in one id space and one LRU, a cap each), with their own reserves (each 0 to 3
/// blocks a sequence) and, in half the cases, their own retention, cap and C.
fn shared_state_setup() -> impl Strategy<Value = Setup> {
    let some_state = || state_setup().prop_filter("a state group", Option::is_some);
    let alignment = || prop::sample::select(vec![1u32, 1, 2, U]);
    let alignments = [alignment(), alignment()];
    (setup(), some_state(), [0u32..=3, 0u32..=3], prop::option::of(some_state()), alignments)
        .prop_map(|(s, state, reserves, second, [first, other])| {
            let state = s.state.or(state).map(|st| StateSetup { reserves, alignment: first, ..st });
            let second = second.flatten().map(|st| StateSetup { alignment: other, ..st });
            Setup { state, states: 2, second, ..s }
        })
}

/// `setup()` with a sliding-window group: blocks of one or two units, windows from one block
/// to two blocks and three tokens, in a pool that never runs short or in one small enough to
/// evict and refuse schedules.
fn windowed_setup() -> impl Strategy<Value = Setup> {
    let window = prop::sample::select(vec![U, 2 * U]).prop_flat_map(|block| {
        prop::sample::select(vec![block, block + 2, 2 * block, 2 * block + 3])
            .prop_map(move |w| (block, w))
    });
    let sw_blocks = prop::sample::select(vec![1024u32, 1024, 10, 16, 28]);
    (setup(), window, sw_blocks).prop_map(|(s, window, sw_blocks)| Setup {
        window: Some(window),
        sw_blocks,
        ..s
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Retire {
    Finish,
    Preempt,
}

#[derive(Clone, Debug)]
struct Step {
    plan: u64,
    start: u32,
    end: u32,
    first: bool,
    /// (initial, running) slots of each state group, from its plan.
    slots: BTreeMap<u32, (i32, i32)>,
    /// Checkpoints the plan gave it: (position, block, decode tail, group), ascending per
    /// group, the groups in order.
    ckpts: Vec<StepCk>,
    /// Positions `request_checkpoint` asked for before its plan was built, in request order.
    requested: Vec<u32>,
    /// Full attention: the table's length before the step, the copy-on-write source its plan
    /// pins (a first step resuming inside a block), and before its plan is built, the keys
    /// whose cached block it pinned and the number of new blocks it took (ids not known yet).
    table_before: usize,
    cow_src: Option<u32>,
    pins: Vec<Pin>,
    new_blocks: u32,
    /// The sliding-window group: its table's length before the step, and the copy-on-write
    /// source its plan pins; before its plan is built, the keys of its hit it pinned (with the
    /// block, when the model can tell which) and its new blocks.
    sw_before: usize,
    sw_cow: Option<u32>,
    sw_pins: Vec<(Vec<u32>, Option<u32>)>,
    sw_new: u32,
}

/// A key of a scheduled first step's hit, with the block it pins when only one carries it, and
/// the copies of it in use when it was scheduled (`None`: another scheduled step pinned one).
type Pin = (Vec<u32>, Option<u32>, Option<BTreeSet<u32>>);

#[derive(Clone, Debug)]
struct Seq {
    id: u64,
    tokens: Vec<u32>,
    /// Its extra keys (salt, adapter, multimodal inputs).
    x: Extras,
    /// Its full-attention block table, as the engine keeps it from the plans' appended entries.
    table: Vec<u32>,
    /// Its sliding-window table (0: outside the window, released), and the same table as an
    /// engine keeps it from the plans' appended and replaced entries.
    sw: Vec<u32>,
    sw_view: Vec<u32>,
    placeholders: u32,
    log: Vec<(u64, u32)>,
    committed: u32,
    started: bool,
    steps: Vec<Step>,
    /// Committed boundaries whose prefix was not known at commit.
    deferred: BTreeSet<u32>,
    retiring: Option<Retire>,
    /// The running slot of its last committed step (the committed state), per state group.
    committed_slot: BTreeMap<u32, i32>,
    /// Running buffers it holds beyond its pair (steps deeper in flight wrote them).
    extras: u32,
    /// Its length (placeholders counted) and junction at its first schedule.
    prefill_target: u32,
    junction: Option<u32>,
    /// The published checkpoints its first step resumes from (one per state group), pinned
    /// until that step ends.
    resume: Vec<u32>,
    /// Its private decode-tail snapshot (block, position), per state group.
    decode_tail: BTreeMap<u32, (u32, u32)>,
    /// Committed checkpoints over placeholders, in commit order.
    waiting: Waiting,
}

impl Seq {
    /// The identity of its first `q` known tokens (q a unit boundary).
    fn key(&self, q: u32) -> Vec<u32> {
        key(&self.tokens, &self.x, q)
    }
    fn len(&self) -> u32 {
        self.tokens.len() as u32 + self.placeholders
    }
    fn planned(&self) -> u32 {
        self.steps.last().map_or(self.committed, |s| s.end)
    }
    /// Whether its running buffers hold one neither its committed state nor any of its steps
    /// uses (the one its next step writes).
    fn has_spare(&self) -> bool {
        let used = usize::from(!self.committed_slot.is_empty()) + self.steps.len();
        2 + self.extras as usize > used
    }
}

/// A sequence's extra keys as the model keeps them: a salt and an adapter id (small numbers),
/// multimodal inputs `(start, end, hash)` with a one-byte hash.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Extras {
    salt: Option<u8>,
    lora: Option<u64>,
    mm: Vec<(u32, u32, u8)>,
}

impl Extras {
    fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    fn core(&self) -> ExtraKeys {
        ExtraKeys {
            cache_salt: self.salt.map(|s| vec![s]),
            lora_id: self.lora,
            multimodal: self
                .mm
                .iter()
                .map(|&(start, end, h)| MultimodalInput { start, end, hash: vec![h] })
                .collect(),
        }
    }

    /// Whether the multimodal inputs are listed in order of their start, ties by end.
    fn in_order(&self) -> bool {
        self.mm.windows(2).all(|w| (w[0].0, w[0].1) <= (w[1].0, w[1].1))
    }

    /// Extra keys from one byte for a prompt of `len` tokens: none half the time, else a
    /// salt, an adapter, one multimodal input or two (the two possibly out of order).
    fn of(e: u8, len: u32) -> Self {
        let v = u32::from(e >> 3);
        let mut x = Self::default();
        let input = |a: u32, b: u32, h: u32| {
            let start = a % len;
            (start, start + 1 + b % (len - start), (h % 3) as u8 + 1)
        };
        match e % 8 {
            4 => x.salt = Some((v % 2) as u8),
            5 => x.lora = Some(u64::from(v % 2)),
            6 => x.mm.push(input(v, v / 3, v / 2)),
            7 => {
                x.mm.push(input(v, v / 3, v / 2));
                x.mm.push(input(v / 5, v / 7, v));
            }
            _ => {}
        }
        x
    }
}

/// The identity of the first `q` tokens of a sequence (q a unit boundary), stated from
/// section 2 rather than from the hash: its salt and adapter (every unit depends on both),
/// then per unit its tokens and the hashes, in list order, of the multimodal inputs whose
/// range overlaps the unit. Two prefixes share a key exactly when their identities are equal,
/// whatever the two sequences share beyond them (`extends`, a live prefix, a finished turn).
fn key(tokens: &[u32], x: &Extras, q: u32) -> Vec<u32> {
    let tag = |v: Option<u64>| v.map_or(0, |v| 1 + v as u32);
    let mut identity = vec![tag(x.salt.map(u64::from)), tag(x.lora)];
    for i in 0..q / U {
        let (lo, hi) = (i * U, (i + 1) * U);
        identity.extend(&tokens[lo as usize..hi as usize]);
        let over: Vec<u32> =
            x.mm.iter().filter(|m| m.0 < hi && m.1 > lo).map(|m| u32::from(m.2)).collect();
        identity.push(over.len() as u32);
        identity.extend(over);
    }
    identity
}

/// The identity of a state group's checkpoint at a prefix: the group, then the prefix's.
fn gkey(g: u32, prefix: &[u32]) -> Vec<u32> {
    let mut k = vec![g];
    k.extend_from_slice(prefix);
    k
}

/// A published checkpoint block.
#[derive(Clone, Debug)]
struct Ck {
    /// Its group, then the identity of its prefix (`gkey`), and its digest.
    prefix: Vec<u32>,
    digest: Digest,
    /// First steps resuming from it.
    pins: u32,
    /// When it was last released at the most recently used end (0: at the least recently used
    /// end, a decode tail published by `finish`).
    since: u64,
    decode_tail: bool,
}

/// When a full-attention block entered the pool's LRU: the model's sync that saw it cached
/// (`call`; one per core call or fewer), and within that sync its place in a release whose
/// order the rules state (`batch`, 0 for none; `rank`, oldest first: a sequence releases its
/// table tail first). Blocks of the same sync are otherwise released in an order no rule
/// states, so neither counts as older.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Since {
    call: u64,
    batch: u64,
    rank: u32,
}

impl Since {
    /// Whether `self` entered the LRU strictly before `other`, by the stated rules.
    fn older(self, other: Self) -> bool {
        self.call < other.call
            || (self.call == other.call
                && self.batch != 0
                && self.batch == other.batch
                && self.rank < other.rank)
    }
}

/// The checkpoint statistics the manager must report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct CkStats {
    published: u64,
    decode_tails: u64,
    skipped: [u64; 5],
    hits: u64,
    evictions: u64,
}

/// A checkpoint a step's plan gave it: (position, block, decode tail, group).
type StepCk = (u32, u32, bool, u32);

/// Checkpoints over placeholders: (group, block, position).
type Waiting = Vec<(u32, u32, u32)>;

/// A plan row's sliding-window table, the engine's view of it, and its copy source.
type WindowRow = (Vec<u32>, Vec<u32>, Option<u32>);

/// A stored key: (group, digest, the block for a checkpoint).
type Stored = (u32, Digest, Option<u32>);

struct Model {
    s: Setup,
    m: CacheManager,
    hash: HashConfig,
    /// Live sequences by id; retiring finished ones by a negative-free serial key.
    seqs: BTreeMap<u64, Seq>,
    retired: BTreeMap<u64, Seq>,
    next_id: u64,
    next_token: u32,
    next_plan: u64,
    next_retired: u64,
    plans: VecDeque<(u64, Vec<(bool, u64)>)>,
    /// Sequences scheduled for the next plan, in order: (retired?, key).
    unbuilt: Vec<(bool, u64)>,
    /// Published full-attention keys (prefix identities) with the blocks carrying them, and
    /// per block the keys it carries with their digests.
    published: BTreeMap<Vec<u32>, BTreeSet<u32>>,
    carried: BTreeMap<u32, BTreeMap<Vec<u32>, Digest>>,
    /// The same for the sliding-window group.
    sw_published: BTreeMap<Vec<u32>, BTreeSet<u32>>,
    sw_carried: BTreeMap<u32, BTreeMap<Vec<u32>, Digest>>,
    /// Events drained before `check_events` (full-attention evictions checked at once).
    drained: Vec<CacheEvent>,
    fa_evictions: u64,
    sw_evictions: u64,
    /// The full-attention blocks the model holds cached (carrying keys, in use by nothing),
    /// with when each entered the LRU (`None`: unknown, a pin the model cannot name may hold
    /// it), the release orders the model's calls stated since the last sync (oldest first),
    /// and the clocks of both.
    fa_lru: BTreeMap<u32, Option<Since>>,
    fa_released: Vec<Vec<u32>>,
    fa_clock: u64,
    fa_batches: u64,

    ended: Vec<u64>,
    /// Published checkpoint blocks, and the unpinned ones, least recently used first.
    ck: BTreeMap<u32, Ck>,
    lru: VecDeque<u32>,
    clock: u64,
    /// Per state group.
    want: Vec<CkStats>,
    /// Keys the calls so far should have stored, and checkpoint blocks they should have
    /// evicted with (digest, gone) (drained per call).
    expect_stored: Vec<Stored>,
    expect_removed: Vec<(u32, Digest, bool)>,
    seen: std::cell::RefCell<BTreeMap<&'static str, u64>>,
}

fn config(s: &Setup) -> CacheConfig {
    let mut groups =
        vec![GroupConfig { kind: GroupKind::FullAttention { block_size: s.block }, pool: 0 }];
    let mut pools = vec![PoolConfig { num_blocks: s.fa_blocks }];
    if let Some(first) = &s.state {
        for i in 0..s.states as usize {
            let st = if i > 0 { s.second.as_ref().unwrap_or(first) } else { first };
            let retention = Retention {
                tail: st.tail,
                interval: st.interval,
                junction: st.junction,
                decode_tail: st.decode_tail,
            };
            groups.push(GroupConfig {
                kind: GroupKind::State(StateGroupConfig {
                    alignment: st.alignment,
                    max_checkpoints_per_step: st.per_step,
                    retention: retention.clone(),
                    checkpoint_cap: st.cap,
                    reserve_per_sequence: first.reserves[i],
                }),
                pool: 1,
            });
        }
        pools.push(PoolConfig { num_blocks: first.blocks });
    }
    if let Some((block_size, window)) = s.window {
        groups.push(GroupConfig {
            kind: GroupKind::SlidingWindow { block_size, window },
            pool: pools.len(),
        });
        pools.push(PoolConfig { num_blocks: s.sw_blocks });
    }
    CacheConfig {
        hash: HashConfig { unit: U, ..HashConfig::default() },
        pools,
        groups,
        max_steps_in_flight: s.depth,
        recently_evicted_capacity: 0,
        ..CacheConfig::default()
    }
}

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(format!($($arg)+));
        }
    };
}

fn kind<T>(r: &Result<T, CacheError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(e) => e.kind(),
    }
}

/// Prefixes (of the given token lists) counted as published, with the plan publishing each.
type Overlay = BTreeMap<Vec<u32>, u64>;

impl Model {
    fn new(s: Setup) -> Self {
        let states = s.states as usize;
        let config = config(&s);
        let m = CacheManager::new(config.clone()).expect("valid configuration");
        Self {
            s,
            m,
            hash: config.hash,
            seqs: BTreeMap::new(),
            retired: BTreeMap::new(),
            next_id: 0,
            next_token: 1_000_000,
            next_plan: 1,
            next_retired: 0,
            plans: VecDeque::new(),
            unbuilt: Vec::new(),
            published: BTreeMap::new(),
            carried: BTreeMap::new(),
            sw_published: BTreeMap::new(),
            sw_carried: BTreeMap::new(),
            drained: Vec::new(),
            fa_evictions: 0,
            sw_evictions: 0,
            fa_lru: BTreeMap::new(),
            fa_released: Vec::new(),
            fa_clock: 0,
            fa_batches: 0,

            ended: Vec::new(),
            ck: BTreeMap::new(),
            lru: VecDeque::new(),
            clock: 0,
            want: vec![CkStats::default(); states],
            expect_stored: Vec::new(),
            expect_removed: Vec::new(),
            seen: std::cell::RefCell::new(BTreeMap::new()),
        }
    }

    fn saw(&self, path: &'static str) {
        *self.seen.borrow_mut().entry(path).or_default() += 1;
    }

    fn classic_busy(&self) -> bool {
        self.s.depth == 1 && !self.plans.is_empty()
    }

    fn pick(&self, pick: u8) -> Option<u64> {
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        (!ids.is_empty()).then(|| ids[usize::from(pick) % ids.len()])
    }

    fn seq_mut(&mut self, key: (bool, u64)) -> &mut Seq {
        if key.0 {
            self.retired.get_mut(&key.1).expect("retired sequence")
        } else {
            self.seqs.get_mut(&key.1).expect("live sequence")
        }
    }

    fn seq_ref(&self, key: (bool, u64)) -> &Seq {
        if key.0 {
            &self.retired[&key.1]
        } else {
            &self.seqs[&key.1]
        }
    }

    /// The digest of the first `q` tokens (q a unit boundary) with the sequence's extra keys,
    /// from the public hash function (whose own statement is checked by `hash_vectors`).
    fn digest(&self, tokens: &[u32], x: &Extras, q: u32) -> Digest {
        let all = hash_prefix(&self.hash, tokens, &x.core()).expect("valid extra keys");
        all[(q / U) as usize - 1]
    }

    // --- checkpoints ---------------------------------------------------------------------

    /// Whether a checkpoint is published at `gk` (`gkey`).
    fn has_ck(&self, gk: &[u32]) -> bool {
        self.ck.values().any(|c| c.prefix == gk)
    }

    fn n_states(&self) -> u32 {
        if self.s.state.is_some() {
            self.s.states
        } else {
            0
        }
    }

    /// The state groups' indices.
    /// The chunk grid: the least common multiple of the state groups' alignments (1 without
    /// one). A chunk that does not reach the sequence's end ends on a multiple of it.
    fn grid(&self) -> u32 {
        let gcd = |mut a: u32, mut b: u32| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        self.state_groups().map(|g| self.st(g).alignment).fold(1, |l, a| l / gcd(l, a) * a)
    }

    /// The retention, cap, C and alignment of state group `g`.
    fn st(&self, g: u32) -> &StateSetup {
        let first = self.s.state.as_ref().expect("a state group");
        if g > STATE {
            self.s.second.as_ref().unwrap_or(first)
        } else {
            first
        }
    }

    fn state_groups(&self) -> std::ops::Range<u32> {
        STATE..STATE + self.n_states()
    }

    fn want_of(&mut self, g: u32) -> &mut CkStats {
        &mut self.want[(g - STATE) as usize]
    }

    /// A published checkpoint no first step pins enters the LRU list: at its most recently
    /// used end, or (a decode tail published by `finish`) at its least recently used end.
    fn release_ck(&mut self, block: u32, most_recent: bool) {
        let c = self.ck.get_mut(&block).expect("published checkpoint");
        if c.pins > 0 {
            return;
        }
        if most_recent {
            self.clock += 1;
            c.since = self.clock;
            self.lru.push_back(block);
        } else {
            c.since = 0;
            self.lru.push_front(block);
        }
    }

    fn pin(&mut self, block: u32) {
        let c = self.ck.get_mut(&block).expect("published checkpoint");
        if c.pins == 0 {
            self.lru.retain(|&b| b != block);
        }
        c.pins += 1;
    }

    fn unpin(&mut self, block: u32) {
        let c = self.ck.get_mut(&block).expect("published checkpoint");
        c.pins -= 1;
        self.release_ck(block, true);
    }

    fn publish_ck(&mut self, who: (&[u32], &Extras), at: (u32, u32), block: u32, dt: bool) {
        let (tokens, x) = who;
        let (g, position) = at;
        let prefix = gkey(g, &key(tokens, x, position));
        if self.has_ck(&prefix) {
            self.saw("a second copy of a checkpoint published");
        }
        let digest = self.digest(tokens, x, position);
        self.expect_stored.push((g, digest, Some(block)));
        let decode_tail = dt;
        self.ck.insert(block, Ck { prefix, digest, pins: 0, since: 0, decode_tail });
        self.release_ck(block, !decode_tail);
        self.want_of(g).published += 1;
        if decode_tail {
            self.want_of(g).decode_tails += 1;
        }
        if g > STATE {
            self.saw("a second state group published a checkpoint");
        }
    }

    fn evict_ck(&mut self, block: u32) {
        let c = self.ck.remove(&block).expect("published checkpoint");
        self.lru.retain(|&b| b != block);
        let gone = !self.has_ck(&c.prefix);
        self.expect_removed.push((block, c.digest, gone));
        self.want_of(c.prefix[0]).evictions += 1;
    }

    /// Started sequences (finished ones whose steps are still in flight included).
    fn started(&self) -> usize {
        self.seqs.values().chain(self.retired.values()).filter(|s| s.started).count()
    }

    /// State-pool blocks free or cached (evictable): the usable ids less the running buffers
    /// (a pair per started sequence, and its extras) and the checkpoint blocks outside the LRU
    /// list.
    fn available(&self) -> usize {
        let Some(st) = &self.s.state else { return usize::MAX };
        let running: usize = self
            .seqs
            .values()
            .chain(self.retired.values())
            .filter(|s| s.started)
            .map(|s| (2 + s.extras as usize) * self.n_states() as usize)
            .sum();
        (st.blocks as usize - 1) - running - (self.ck_blocks(None) - self.lru.len())
    }

    /// A state-pool block taken (`taken` more already taken but not yet counted): a free one,
    /// else the least recently used cached checkpoint, evicted.
    fn take_state_block(&mut self, taken: usize) {
        if self.available() - taken == self.lru.len() {
            let victim = self.lru[0];
            self.saw(if self.ck[&victim].decode_tail {
                "the pool evicted a decode tail first"
            } else {
                "the pool evicted its least recently used checkpoint"
            });
            self.evict_ck(victim);
        }
    }

    /// Checkpoint blocks a state group holds (all of them: `None`): published, planned by
    /// built steps, waiting for their tokens, private decode tails.
    fn ck_blocks(&self, group: Option<u32>) -> usize {
        let of = |g: u32| group.is_none_or(|x| x == g);
        let per_seq = |s: &Seq| {
            s.steps.iter().flat_map(|st| &st.ckpts).filter(|c| of(c.3)).count()
                + s.waiting.iter().filter(|w| of(w.0)).count()
                + s.decode_tail.keys().filter(|&&g| of(g)).count()
        };
        self.ck.values().filter(|c| of(c.prefix[0])).count()
            + self.seqs.values().chain(self.retired.values()).map(per_seq).sum::<usize>()
    }

    // --- the full-attention pool ------------------------------------------------------------
    //
    // Stated here: a started sequence holds the blocks of its table (`ceil(planned / B)`: the
    // blocks of its hit, then its own), a built first step resuming inside a block also pins
    // the copy-on-write source until its plan ends; a scheduled first step pins, before it
    // allocates anything, one cached block for each key of its hit (block boundaries, and the
    // hit itself inside a block) no block in use serves. A schedule needs those pins and its
    // new blocks from what is free or cached, else it is refused; an abort gives back what the
    // undone steps took (the tables as they were before the oldest plan), a sequence released
    // after its last step its whole table. Only an unheld block may be evicted, with exactly
    // the keys it carries, and a key leaves the index when no block carries it.

    /// Full-attention blocks in use, by id: tables of started sequences, and the copy-on-write
    /// sources of built steps.
    fn held_ids(&self) -> BTreeSet<u32> {
        let mut held = BTreeSet::new();
        for seq in self.seqs.values().chain(self.retired.values()).filter(|s| s.started) {
            held.extend(seq.table.iter().copied());
            held.extend(seq.steps.iter().filter(|st| st.plan != 0).filter_map(|st| st.cow_src));
        }
        held
    }

    /// The pins of steps scheduled for the next plan.
    fn unbuilt_pins(&self) -> impl Iterator<Item = &Pin> {
        self.seqs
            .values()
            .chain(self.retired.values())
            .flat_map(|s| s.steps.iter().filter(|st| st.plan == 0))
            .flat_map(|st| st.pins.iter())
    }

    /// Blocks held or pinned by a scheduled step (where the model knows which).
    fn owned_ids(&self) -> BTreeSet<u32> {
        let mut owned = self.held_ids();
        owned.extend(self.unbuilt_pins().filter_map(|p| p.1));
        owned
    }

    /// Whether a scheduled step pins a block of a key several blocks carry (which one, the
    /// model cannot tell without the pool's recency: its counts are then not checked).
    fn fuzzy(&self) -> bool {
        self.unbuilt_pins().any(|p| p.1.is_none())
    }

    /// Full-attention blocks free or cached (evictable), `None` when fuzzy.
    fn fa_available(&self) -> Option<usize> {
        if self.fuzzy() {
            return None;
        }
        let new: usize = self
            .seqs
            .values()
            .chain(self.retired.values())
            .flat_map(|s| s.steps.iter().filter(|st| st.plan == 0))
            .map(|st| st.new_blocks as usize)
            .sum();
        Some((self.s.fa_blocks as usize - 1) - self.owned_ids().len() - new)
    }

    /// What a schedule of `seq` up to `end` takes from the pool (`hit`: a first one's): the
    /// keys of its hit it pins (with the block when only one carries the key), how many of
    /// them no block in use serves (each pins a cached block), and its new blocks.
    fn fa_need(&self, seq: &Seq, hit: Option<u32>, end: u32) -> (Vec<Pin>, usize, u32) {
        let b = self.s.block;
        let blocks = end.div_ceil(b);
        let Some(l) = hit else {
            return (Vec::new(), 0, blocks.saturating_sub(seq.table.len() as u32));
        };
        let owned = self.owned_ids();
        let pinned: BTreeSet<&Vec<u32>> = self.unbuilt_pins().map(|p| &p.0).collect();
        let mut needed: Vec<u32> = (1..=l / b).map(|j| j * b).collect();
        if l % b != 0 {
            needed.push(l);
        }
        let mut pins = Vec::new();
        let mut extra = 0;
        for q in needed {
            let k = seq.key(q);
            let copies = self.published.get(&k).cloned().unwrap_or_default();
            let used: BTreeSet<u32> =
                copies.iter().copied().filter(|x| owned.contains(x)).collect();
            let in_use = !used.is_empty() || pinned.contains(&k);
            extra += usize::from(!in_use);
            // The copy it pins: the only one; else one in use (when the model knows the only
            // one); else the most recently used, where the LRU order tells it.
            let chosen = if copies.len() == 1 {
                copies.first().copied()
            } else if self.fuzzy() {
                None
            } else if used.len() == 1 {
                used.first().copied()
            } else if used.is_empty() {
                self.most_recent_copy(&copies)
            } else {
                None
            };
            if copies.len() > 1 && chosen.is_some() {
                self.saw(if used.is_empty() {
                    "a hit pinned the most recent of several cached copies"
                } else {
                    "a hit pinned the copy in use of several"
                });
            }
            // (unknown when a scheduled step pins a block the model cannot name: that block
            // may carry this key too)
            let used = (!pinned.contains(&k) && !self.fuzzy()).then_some(used);
            pins.push((k, chosen, used));
        }
        (pins, extra, blocks - l / b)
    }

    /// Drains the manager's events: full-attention evictions are checked against what is held
    /// now (before the call's own allocations are known), the rest kept for `check_events`.
    ///
    /// A cached block is evicted only when no block is free: a schedule (`allocates`: its own
    /// pins and new blocks) evicts exactly the blocks it needs beyond the free ones, each the
    /// least recently used of those cached (no block left in place entered the LRU before it,
    /// by `Since::older`).
    fn take_removals(&mut self, allocates: Option<(&[Pin], u32)>) -> Result<(), String> {
        self.sync_fa_lru();
        // (the schedule's own pins, taken before it allocates, are not candidates either)
        let own = allocates.map_or(&[][..], |a| a.0);
        let fuzzy = self.fuzzy() || own.iter().any(|p| p.1.is_none());
        let mut not_candidates: BTreeSet<u32> = own.iter().filter_map(|p| p.1).collect();
        for p in own.iter().filter(|p| p.1.is_none()) {
            not_candidates.extend(self.published.get(&p.0).into_iter().flatten());
        }
        let mut cached_before = self.fa_cached();
        let cached = cached_before.len();
        for p in own {
            cached_before.remove(&p.1.unwrap_or_default());
        }
        let mut victims = Vec::new();
        let held = self.owned_ids();
        let pinned: BTreeSet<Vec<u32>> = self.unbuilt_pins().map(|p| p.0.clone()).collect();
        for r in self.m.drain_events() {
            let CacheEvent::BlockRemoved { group: 0, block, keys, gone } = r.event else {
                self.drained.push(r.event);
                continue;
            };
            ensure!(!held.contains(&block), "evicted full-attention block {block} is in use");
            // The least recently used cached block goes first.
            let since = self.fa_lru.remove(&block);
            ensure!(since.is_some(), "evicted full-attention block {block} is not cached");
            if let Some(Some(since)) = since {
                let candidates: Vec<(u32, Since)> = self
                    .fa_lru
                    .iter()
                    .filter(|(b, _)| !not_candidates.contains(b))
                    .filter_map(|(b, t)| t.map(|t| (*b, t)))
                    .collect();
                let older: Vec<&(u32, Since)> =
                    candidates.iter().filter(|(_, t)| t.older(since)).collect();
                ensure!(
                    older.is_empty(),
                    "evicted block {block} (cached at {since:?}) before less recently used \
                     ones {older:?}"
                );
                if candidates.iter().any(|(_, t)| since.older(*t)) {
                    self.saw("an eviction took the least recently used of several");
                }
                if candidates.iter().any(|(_, t)| t.call == since.call && since.older(*t)) {
                    self.saw("an eviction took the tail of a released table first");
                }
            }
            let carried = self
                .carried
                .remove(&block)
                .ok_or_else(|| format!("evicted full-attention block {block} carries no key"))?;
            let (got, want) = (sorted(keys.iter().copied()), sorted(carried.values().copied()));
            ensure!(got == want, "evicted block {block} with keys {got:?}, it carries {want:?}");
            let mut no_longer = Vec::new();
            for (k, d) in carried {
                let blocks = self.published.get_mut(&k).expect("a published key");
                blocks.remove(&block);
                if blocks.is_empty() {
                    self.published.remove(&k);
                    ensure!(
                        !pinned.contains(&k),
                        "evicted block {block}, the only one of a key a scheduled step pinned"
                    );
                    no_longer.push(d);
                }
            }
            let mut gone = gone.clone();
            gone.sort_unstable();
            no_longer.sort_unstable();
            ensure!(
                gone == no_longer,
                "evicted block {block}: gone {gone:?}, expected {no_longer:?}"
            );
            self.fa_evictions += 1;
            self.saw("full-attention block evicted");
            victims.push(block);
        }
        if fuzzy {
            return Ok(());
        }
        if let Some((_, new)) = allocates {
            // (the blocks of steps scheduled before it, ids not known yet, are not free)
            let available = self.fa_available().ok_or("fuzzy")?;
            let free = available - cached;
            let expected = (new as usize).saturating_sub(free);
            ensure!(
                victims.len() == expected,
                "a schedule of {new} new blocks with {free} free evicted {} blocks, expected \
                 {expected}",
                victims.len()
            );
            if expected > 0 && cached_before.len() > expected {
                self.saw("a schedule evicted some of several cached blocks");
            }
        }
        Ok(())
    }

    /// Full-attention blocks cached: carrying keys, not held or pinned (where the model knows).
    fn fa_cached(&self) -> BTreeSet<u32> {
        let owned = self.owned_ids();
        self.carried.keys().copied().filter(|b| !owned.contains(b)).collect()
    }

    // The LRU order of the full-attention pool, stated here (sections 2 and 3): a published
    // block enters the LRU, as its most recently used entry, when the last holder lets go of
    // it (a table released, a copy-on-write source at its plan's end, a hit pin given back by
    // a schedule that was dropped or undone); a pin takes it out again, whatever pinned it.
    // A sequence releases its table tail first. An allocation takes a free block first, else
    // evicts the least recently used cached one. Which copy of a key a first schedule pins:
    // one in use if there is one, else the most recently used.

    /// Brings the model's LRU up to date with who holds what now: blocks no longer cached
    /// leave it, newly cached ones enter it as the most recent (ranked within a stated
    /// release order), and the copies of a key that a scheduled step pinned without the model
    /// knowing which lose their place (`None`).
    fn sync_fa_lru(&mut self) {
        let cached = self.fa_cached();
        self.fa_lru.retain(|b, _| cached.contains(b));
        self.fa_clock += 1;
        let call = self.fa_clock;
        let mut order: BTreeMap<u32, (u64, u32)> = BTreeMap::new();
        for release in std::mem::take(&mut self.fa_released) {
            self.fa_batches += 1;
            for (rank, &b) in release.iter().enumerate() {
                order.entry(b).or_insert((self.fa_batches, rank as u32));
            }
        }
        for b in cached {
            if let std::collections::btree_map::Entry::Vacant(e) = self.fa_lru.entry(b) {
                let (batch, rank) = order.get(&b).copied().unwrap_or((0, 0));
                e.insert(Some(Since { call, batch, rank }));
            }
        }
        let unknown: Vec<Vec<u32>> =
            self.unbuilt_pins().filter(|p| p.1.is_none()).map(|p| p.0.clone()).collect();
        for k in unknown {
            for b in self.published.get(&k).into_iter().flatten() {
                if let Some(since) = self.fa_lru.get_mut(b) {
                    *since = None;
                }
            }
        }
    }

    /// The most recently used of several cached copies, when the rules tell it.
    fn most_recent_copy(&self, copies: &BTreeSet<u32>) -> Option<u32> {
        let since: Vec<(u32, Since)> = copies
            .iter()
            .map(|b| self.fa_lru.get(b).copied().flatten().map(|s| (*b, s)))
            .collect::<Option<_>>()?;
        since
            .iter()
            .find(|(b, s)| since.iter().all(|(c, t)| c == b || t.older(*s)))
            .map(|&(b, _)| b)
    }

    /// A row's full-attention table entries and copy against the model: the plan appends the
    /// entries from the table's length up to `ceil(end / B)` (a first step's hit blocks first,
    /// each carrying its key), and a first step resuming inside a block copies from a block
    /// carrying the key at its hit. Returns the table and the copy source.
    fn check_table_row(
        &mut self,
        plan: &prefixcache_core::StepPlan,
        row: usize,
        seq: &Seq,
        step: &Step,
    ) -> Result<(Vec<u32>, Option<u32>), String> {
        let b = self.s.block;
        let mut table = seq.table.clone();
        for e in plan.paged[0].appended.chunks(3).filter(|e| e[0] as usize == row) {
            ensure!(
                e[1] as usize == table.len() && e[2] > 0 && (e[2] as u32) < self.s.fa_blocks,
                "row {row}: appended {e:?} to a table of {}",
                table.len()
            );
            table.push(e[2] as u32);
        }
        ensure!(
            table.len() as u32 == step.end.div_ceil(b),
            "row {row}: a table of {} blocks for [0, {})",
            table.len(),
            step.end
        );
        let copies: Vec<&[i64]> = plan
            .copies
            .chunks(4)
            .filter(|c| c[0] == 0 && c[2] == i64::from(table[(step.start / b) as usize]))
            .collect();
        let mut cow_src = None;
        if step.first {
            let l = step.start;
            // (a hit uses a copy in use at its schedule when there was one)
            let check = |this: &Self, q: u32, block: u32| -> Result<(), String> {
                let k = seq.key(q);
                let carries = this.carried.get(&block).is_some_and(|c| c.contains_key(&k));
                ensure!(
                    carries,
                    "row {row}: block {block} of the hit does not carry the key at {q}"
                );
                let pin = step.pins.iter().find(|p| p.0 == k);
                if let Some(chosen) = pin.and_then(|p| p.1) {
                    ensure!(
                        chosen == block,
                        "row {row}: the hit at {q} uses block {block}, expected {chosen} (the \
                         copy in use, else the most recently used)"
                    );
                }
                let used = pin.and_then(|p| p.2.as_ref());
                if let Some(used) = used.filter(|u| !u.is_empty()) {
                    ensure!(
                        used.contains(&block),
                        "row {row}: the hit at {q} uses block {block}, not a copy in use {used:?}"
                    );
                }
                Ok(())
            };
            for j in 0..l / b {
                check(self, (j + 1) * b, table[j as usize])?;
            }
            if l % b != 0 {
                ensure!(
                    copies.len() == 1 && copies[0][3] == i64::from(l % b),
                    "row {row}: copies {:?} for a hit at {l}",
                    plan.copies
                );
                let src = copies[0][1] as u32;
                check(self, l, src)?;
                cow_src = Some(src);
                self.saw("copy on write");
            }
            if l >= b && self.s.fa_blocks < 1024 {
                self.saw("first step shared cached blocks");
            }
        }
        if cow_src.is_none() {
            ensure!(
                copies.is_empty(),
                "row {row}: copies {:?} without a hit inside a block",
                plan.copies
            );
        }
        Ok((table, cow_src))
    }

    /// A row's sliding-window entries and copy against the model: the plan appends the
    /// entries from the table's length up to `ceil(end / B)` (a first step's: nulls outside
    /// the window, its hit's blocks, each carrying its key, then its own), replaces only
    /// entries the window released, and an engine applying both holds the model's table; a
    /// first step resuming inside a block copies from a block carrying the key at its hit.
    /// Returns the table, the engine's view and the copy source.
    fn check_sw_row(
        &self,
        plan: &prefixcache_core::StepPlan,
        row: usize,
        seq: &Seq,
        step: &Step,
    ) -> Result<WindowRow, String> {
        let (b, window) = self.s.window.ok_or("no window")?;
        let g = self.sw_group();
        let gp = plan.paged.iter().find(|p| p.group == g).ok_or("no sliding-window plan")?;
        let mut table = if step.first { Vec::new() } else { seq.sw.clone() };
        let mut view = seq.sw_view.clone();
        for e in gp.appended.chunks(3).filter(|e| e[0] as usize == row) {
            let col = e[1] as usize;
            ensure!(
                col == table.len() && e[2] >= 0 && e[2] < 1024,
                "row {row}: appended {e:?} to a window table of {}",
                table.len()
            );
            table.push(e[2] as u32);
            if view.len() <= col {
                view.resize(col + 1, 0);
            }
            view[col] = e[2] as u32;
        }
        for e in gp.replaced.chunks(3).filter(|e| e[0] as usize == row) {
            let col = e[1] as usize;
            ensure!(
                e[2] == 0 && table.get(col) == Some(&0) && !step.first,
                "row {row}: replaced {e:?}, not an entry the window released ({table:?})"
            );
            view[col] = 0;
            self.saw("a plan reported a window release");
        }
        ensure!(
            table.len() as u32 == step.end.div_ceil(b),
            "row {row}: a window table of {} blocks for [0, {})",
            table.len(),
            step.end
        );
        ensure!(
            view[..table.len()] == table[..],
            "row {row}: the engine's window table {view:?} after the plan, the model's {table:?}"
        );
        // (this row's: the copy's destination is its table's entry at its start)
        let dst = table.get((step.start / b) as usize).map(|&d| i64::from(d));
        let copies: Vec<&[i64]> =
            plan.copies.chunks(4).filter(|c| c[0] == i64::from(g) && Some(c[2]) == dst).collect();
        let carries = |block: u32, q: u32| {
            self.sw_carried.get(&block).is_some_and(|keys| keys.contains_key(&seq.key(q)))
        };
        let (l, first_col) =
            if step.first { (step.start, step.start.saturating_sub(window) / b) } else { (0, 0) };
        for (c, &block) in table.iter().enumerate().skip(if step.first { 0 } else { seq.sw.len() })
        {
            let c = c as u32;
            if c < first_col {
                ensure!(block == 0, "row {row}: window entry {c} is {block}, outside the window");
                self.saw("a first step's window table starts with nulls");
            } else if c < l / b {
                ensure!(
                    carries(block, (c + 1) * b),
                    "row {row}: window block {block} of the hit does not carry the key at {}",
                    (c + 1) * b
                );
            } else {
                ensure!(block > 0, "row {row}: a null window entry {c} for its own tokens");
            }
        }
        let mut cow = None;
        if step.first && l % b != 0 {
            ensure!(
                copies.len() == 1
                    && copies[0][3] == i64::from(l % b)
                    && copies[0][2] == i64::from(table[(l / b) as usize]),
                "row {row}: window copies {copies:?} for a hit at {l}"
            );
            let src = copies[0][1] as u32;
            ensure!(carries(src, l), "row {row}: window copy from {src}, not the key at {l}");
            cow = Some(src);
            self.saw("window copy on write");
        } else {
            ensure!(copies.is_empty(), "row {row}: window copies {copies:?} without a hit inside");
        }
        Ok((table, view, cow))
    }

    /// Publishes boundary `q` of a sequence (known) in the window block holding token q - 1,
    /// unless the window released it (false).
    fn publish_sw(&mut self, who: (&[u32], &Extras), sw: &[u32], q: u32) -> bool {
        let Some((b, _)) = self.s.window else { return false };
        let (tokens, x) = who;
        let block = sw[((q - 1) / b) as usize];
        if block == 0 {
            return false;
        }
        let digest = self.digest(tokens, x, q);
        self.expect_stored.push((self.sw_group(), digest, Some(block)));
        let k = key(tokens, x, q);
        self.sw_published.entry(k.clone()).or_default().insert(block);
        self.sw_carried.entry(block).or_default().insert(k, digest);
        true
    }

    /// The window blocks a sequence no longer reads once `computed` tokens are committed are
    /// released (their entries null).
    fn release_window(&mut self, key: (bool, u64)) {
        let Some((b, w)) = self.s.window else { return };
        let seq = self.seq_mut(key);
        let keep_from = (seq.committed.saturating_sub(w) / b) as usize;
        let mut released = false;
        for entry in seq.sw.iter_mut().take(keep_from) {
            released |= *entry != 0;
            *entry = 0;
        }
        if released {
            self.saw("window blocks released at commit");
        }
    }

    // The sliding-window pool, stated here (sections 2 and 3): a started sequence holds the
    // entries of its window table (the ones the window released are null), a built first
    // step resuming inside a block also its copy-on-write source until its plan ends, and a
    // scheduled first step pins, before allocating, for each key its window needs at its hit
    // (`sw_required`) a cached block when no copy of the key is in use (a hit uses a copy in
    // use when there is one). A schedule's new window blocks are `ceil(end / B)` less the
    // table it has (a first step's: the hit's columns, nulls included). Blocks carrying keys
    // and in use by nothing are cached, the others free. A schedule whose pins and new blocks
    // exceed the free and cached ones is refused (`None`) and changes nothing; otherwise it
    // takes free blocks first and evicts exactly the rest, each a cached block, removed with
    // exactly the keys it carries, and never the last copy of a key a scheduled step pinned.

    /// Window blocks held by started sequences (their tables), built steps (copy sources)
    /// and steps waiting for the next plan (the hit blocks they pinned, where the model knows
    /// which).
    fn sw_owned(&self) -> BTreeSet<u32> {
        let mut owned = BTreeSet::new();
        for seq in self.seqs.values().chain(self.retired.values()).filter(|s| s.started) {
            owned.extend(seq.sw.iter().copied().filter(|&b| b != 0));
            owned.extend(seq.steps.iter().filter_map(|st| st.sw_cow));
            owned.extend(seq.steps.iter().flat_map(|st| st.sw_pins.iter().filter_map(|p| p.1)));
        }
        owned
    }

    /// What steps waiting for the next plan hold in the window pool: the keys they pinned,
    /// whether the model cannot tell a pinned block (one of several copies), and their new
    /// blocks.
    fn sw_unbuilt(&self) -> (BTreeSet<Vec<u32>>, bool, usize) {
        let steps = self
            .seqs
            .values()
            .chain(self.retired.values())
            .flat_map(|s| s.steps.iter().filter(|st| st.plan == 0));
        let (mut keys, mut unknown, mut new) = (BTreeSet::new(), false, 0);
        for st in steps {
            keys.extend(st.sw_pins.iter().map(|p| p.0.clone()));
            unknown |= st.sw_pins.iter().any(|p| p.1.is_none());
            new += st.sw_new as usize;
        }
        (keys, unknown, new)
    }

    /// The window pool's (free, cached) blocks; `None` when a step waiting for the next plan
    /// pinned a block the model cannot name.
    fn sw_room(&self) -> Option<(usize, usize)> {
        let owned = self.sw_owned();
        let (_, unknown, new) = self.sw_unbuilt();
        if unknown {
            return None;
        }
        let carried = self.sw_carried.keys().filter(|b| !owned.contains(b)).count();
        // (saturating: a model that lost count is reported by `check_sw_pool`)
        let free = (self.s.sw_blocks as usize - 1).saturating_sub(owned.len() + new + carried);
        Some((free, carried))
    }

    /// What a schedule of `seq` up to `end` takes from the window pool (`hit`: a first one's):
    /// the keys it pins, each with its block where the model can tell (the only copy, else
    /// the only one in use), how many of them pin a cached block (no copy in use), and its
    /// new blocks.
    #[allow(clippy::type_complexity)]
    fn sw_need(
        &self,
        seq: &Seq,
        hit: Option<u32>,
        end: u32,
    ) -> (Vec<(Vec<u32>, Option<u32>)>, u32, u32) {
        let Some((b, _)) = self.s.window else { return (Vec::new(), 0, 0) };
        let cols = end.div_ceil(b);
        let Some(l) = hit else {
            return (Vec::new(), 0, cols.saturating_sub(seq.sw.len() as u32));
        };
        let owned = self.sw_owned();
        let (pinned, _, _) = self.sw_unbuilt();
        let (mut pins, mut extra) = (Vec::new(), 0);
        for q in self.sw_required(l) {
            let k = seq.key(q);
            let copies = self.sw_published.get(&k).cloned().unwrap_or_default();
            let used: Vec<u32> = copies.iter().copied().filter(|c| owned.contains(c)).collect();
            // (a key another waiting step pinned is in use, whichever copy that is)
            extra += u32::from(used.is_empty() && !pinned.contains(&k));
            let block = if copies.len() == 1 {
                copies.first().copied()
            } else if used.len() == 1 {
                Some(used[0])
            } else {
                None
            };
            if copies.len() > 1 && block.is_none() {
                self.saw("a window hit pinned one of several copies");
            }
            pins.push((k, block));
        }
        (pins, extra, cols - l / b)
    }

    /// The window blocks a call evicted (its `BlockRemoved` events of the window group, taken
    /// out of `drained`), checked against what was held before it; `own`: the keys the call's
    /// schedule pinned. Returns how many.
    fn take_sw_removals(&mut self, own: &[(Vec<u32>, Option<u32>)]) -> Result<usize, String> {
        if self.s.window.is_none() {
            return Ok(0);
        }
        let g = self.sw_group();
        let mut owned = self.sw_owned();
        owned.extend(own.iter().filter_map(|p| p.1));
        let (mut pinned, _, _) = self.sw_unbuilt();
        pinned.extend(own.iter().map(|p| p.0.clone()));
        let mut evicted = 0;
        for event in std::mem::take(&mut self.drained) {
            let CacheEvent::BlockRemoved { group, block, keys, gone } = &event else {
                self.drained.push(event);
                continue;
            };
            if *group != g {
                self.drained.push(event);
                continue;
            }
            ensure!(!owned.contains(block), "evicted window block {block} is in use");
            let carried = self
                .sw_carried
                .remove(block)
                .ok_or_else(|| format!("evicted window block {block} carries no key"))?;
            let (got, want) = (sorted(keys.iter().copied()), sorted(carried.values().copied()));
            ensure!(got == want, "evicted window block {block} with {got:?}, it carries {want:?}");
            let mut no_longer = Vec::new();
            for (k, d) in carried {
                let blocks = self.sw_published.get_mut(&k).ok_or("a published window key")?;
                blocks.remove(block);
                if blocks.is_empty() {
                    self.sw_published.remove(&k);
                    ensure!(
                        !pinned.contains(&k),
                        "evicted window block {block}, the last copy of a key a step pinned"
                    );
                    no_longer.push(d);
                } else if pinned.contains(&k) {
                    self.saw("a window eviction left the copy of a pinned key");
                }
            }
            let mut gone = gone.clone();
            gone.sort_unstable();
            no_longer.sort_unstable();
            ensure!(gone == no_longer, "evicted window block {block}: gone {gone:?}");
            evicted += 1;
            self.sw_evictions += 1;
            self.saw("sliding-window block evicted");
        }
        Ok(evicted)
    }

    /// The sliding-window pool's owned and cached blocks: what `sw_room` says, and what steps
    /// waiting for the next plan pinned and took.
    fn check_sw_pool(&self) -> Result<(), String> {
        if self.s.window.is_none() {
            return Ok(());
        }
        let Some((free, cached)) = self.sw_room() else { return Ok(()) };
        let usage = self.m.pool_usage()[self.sw_group() as usize];
        ensure!(
            usage.free as usize == free && usage.cached as usize == cached,
            "sliding-window pool {usage:?}: the model has {free} free, {cached} cached (held \
             {:?}, waiting for the next plan {:?}, carrying keys {:?})",
            self.sw_owned(),
            self.sw_unbuilt(),
            self.sw_carried.keys().collect::<Vec<_>>()
        );
        Ok(())
    }

    // --- the hit rule ----------------------------------------------------------------------

    /// The full-attention bound of known `tokens` below `max`: the largest L whose block
    /// boundaries, and L itself when it ends inside a block, are published (or in `extra`).
    fn fa_bound(&self, seq: &Seq, max: u32, extra: &Overlay) -> u32 {
        let has = |q: u32| {
            let p = seq.key(q);
            self.published.contains_key(&p) || extra.contains_key(&p)
        };
        let b = self.s.block;
        (0..=max / U)
            .rev()
            .map(|i| i * U)
            .find(|&l| (1..=l / b).all(|j| has(j * b)) && (l % b == 0 || has(l)))
            .unwrap_or(0)
    }

    /// The state group's own hit within `bound`: a checkpoint at exactly L, or 0.
    fn state_own(&self, g: u32, seq: &Seq, bound: u32, extra: &Overlay) -> u32 {
        (0..=bound / U)
            .rev()
            .map(|i| i * U)
            .find(|&l| {
                let p = gkey(g, &seq.key(l));
                l == 0 || self.has_ck(&p) || extra.contains_key(&p)
            })
            .unwrap_or(0)
    }

    /// What in-flight steps will publish (their prefix known): unit boundaries of full
    /// attention, and checkpoints (not decode tails), each with the first plan publishing it.
    fn pending(&self) -> (Overlay, Overlay) {
        let (mut fa, mut ck): (Overlay, Overlay) = (BTreeMap::new(), BTreeMap::new());
        let add = |map: &mut Overlay, p: Vec<u32>, plan: u64| {
            let e = map.entry(p).or_insert(plan);
            *e = (*e).min(plan);
        };
        for seq in self.seqs.values().chain(self.retired.values()) {
            let known = seq.tokens.len() as u32;
            for step in seq.steps.iter().filter(|s| s.plan != 0) {
                let mut q = (step.start / U + 1) * U;
                while q <= step.end && q <= known {
                    add(&mut fa, seq.key(q), step.plan);
                    q += U;
                }
                for &(p, _, dt, g) in &step.ckpts {
                    if !dt && p <= known {
                        add(&mut ck, gkey(g, &seq.key(p)), step.plan);
                    }
                }
            }
        }
        (fa, ck)
    }

    /// The whole `Hit` a lookup of `seq` must return now; `pending` is `self.pending()`
    /// (computed once for several lookups), `None` when no plan is in flight.
    fn expected_hit(&self, seq: &Seq, pending: Option<&(Overlay, Overlay)>) -> Hit {
        let tokens = &seq.tokens;
        let n = tokens.len() as u32;
        let max = if n == 0 { 0 } else { (n - 1) / U * U };
        let none = BTreeMap::new();
        let bound = self.fa_bound(seq, max, &none);
        let candidates = |top: u32| (0..=top / U).rev().map(|i| i * U);
        // Every group but full attention resumes at L on its own (not downward closed): the
        // hit is the largest candidate within the bound that all of them allow.
        let state_at = |l: u32, ck: &Overlay| {
            let p = seq.key(l);
            l == 0
                || self.state_groups().all(|g| {
                    let gk = gkey(g, &p);
                    self.has_ck(&gk) || ck.contains_key(&gk)
                })
        };
        let hit_within = |top: u32, fa: &Overlay, ck: &Overlay| {
            candidates(top).find(|&l| state_at(l, ck) && self.sw_allows(seq, l, fa)).unwrap_or(0)
        };
        let hit_tokens = hit_within(bound, &none, &none);
        let mut groups = vec![GroupHit {
            group: 0,
            tokens: bound,
            stop: (bound < max).then_some(MissReason::NotCached),
        }];
        for g in self.state_groups() {
            let own = self.state_own(g, seq, bound, &none);
            groups.push(GroupHit {
                group: g,
                tokens: own,
                stop: (own < max).then_some(MissReason::NoStateAtPosition),
            });
        }
        if self.s.window.is_some() {
            let own = candidates(bound).find(|&l| self.sw_allows(seq, l, &none)).unwrap_or(0);
            // (a window explains its largest candidate: its last key missing is not cached,
            // so is a candidate it allows but full attention bounds; else a gap)
            let stop = (own < max).then(|| {
                if !self.sw_published.contains_key(&seq.key(max)) || self.sw_allows(seq, max, &none)
                {
                    MissReason::NotCached
                } else {
                    MissReason::WindowGap
                }
            });
            if stop == Some(MissReason::WindowGap) {
                self.saw("a window gap stops the sliding-window group");
            }
            groups.push(GroupHit { group: self.sw_group(), tokens: own, stop });
        }
        let junction_at = |top: u32| (top >= hit_tokens + 2 * U).then_some(top);
        let mut hit = Hit {
            tokens: hit_tokens,
            max_tokens: max,
            groups,
            junction: junction_at(bound),
            pending_tokens: hit_tokens,
            pending_plan: None,
        };
        let Some((fa, ck)) = pending else { return hit };
        let bound_p = self.fa_bound(seq, max, fa);
        let own_p = hit_within(bound_p, fa, ck);
        if self.s.depth > 1 {
            hit.junction = junction_at(bound_p);
        }
        if own_p > hit_tokens {
            let b = self.s.block;
            // (kind: 0 full attention, 1 window, 2 + g state group g; position) of every key
            // the pending hit needs.
            let mut needed: Vec<(u32, u32)> = (1..=own_p / b).map(|j| (0, j * b)).collect();
            needed.push((0, own_p));
            needed.extend(self.state_groups().map(|g| (2 + g, own_p)));
            needed.extend(self.sw_required(own_p).into_iter().map(|q| (1, q)));
            let plan = needed
                .into_iter()
                .filter_map(|(kind, q)| {
                    let p = seq.key(q);
                    let (cached, overlay, p) = match kind {
                        0 => (self.published.contains_key(&p), fa, p),
                        1 => (self.sw_published.contains_key(&p), fa, p),
                        _ => {
                            let gk = gkey(kind - 2, &p);
                            (self.has_ck(&gk), ck, gk)
                        }
                    };
                    (!cached).then(|| overlay.get(&p).copied()).flatten()
                })
                .max();
            hit.pending_tokens = own_p;
            hit.pending_plan = plan;
        }
        hit
    }

    // --- the sliding-window group -----------------------------------------------------------
    //
    // Stated here (sections 2 and 3): a window of W tokens needs, to resume at L, the blocks
    // covering `[max(0, L - W), L)` (their keys: each block's end, or L inside the last), so a
    // first step's table holds nulls before `max(0, L - W) / B`, then its hit's blocks (a copy
    // on write when L ends inside a block), then its own. A block is released once all its
    // tokens lie before the last W computed ones (`(j + 1) * B <= computed - W`, at each
    // commit), its entry becoming null; the next plan of the sequence reports the released
    // entries, so an engine applying the plans' appended and replaced entries holds the table.
    // Keys are published as for full attention, into the block holding token q - 1; a key
    // waiting for its tokens whose block was released meanwhile is never published (the
    // block may have been reused). Its pool may run short (see `sw_room`).

    /// The sliding-window group's index (and its pool's): after the state group, if any.
    fn sw_group(&self) -> u32 {
        1 + self.n_states()
    }

    /// The key positions the window needs to resume at `l`.
    fn sw_required(&self, l: u32) -> Vec<u32> {
        let Some((b, w)) = self.s.window else { return Vec::new() };
        if l == 0 {
            return Vec::new();
        }
        (l.saturating_sub(w) / b..=(l - 1) / b).map(|c| ((c + 1) * b).min(l)).collect()
    }

    /// Whether the window allows resuming at `l` (every key it needs published, or in
    /// `extra`); always without a window.
    fn sw_allows(&self, seq: &Seq, l: u32, extra: &Overlay) -> bool {
        self.sw_required(l).into_iter().all(|q| {
            let k = seq.key(q);
            self.sw_published.contains_key(&k) || extra.contains_key(&k)
        })
    }

    /// The copy of the checkpoint at `prefix` a first schedule pins: one already in use if
    /// there is one, else the most recently released, ties to the lowest id.
    fn resume_choice(&self, prefix: &[u32]) -> Option<u32> {
        self.ck
            .iter()
            .filter(|(_, c)| c.prefix == prefix)
            .max_by_key(|(&b, c)| (c.pins > 0, c.since, std::cmp::Reverse(b)))
            .map(|(&b, _)| b)
    }

    /// Publishes boundary `q` of a sequence's tokens (known), recording the expected key.
    /// Publishes boundary `q` of a sequence (known) in the block of its table holding token
    /// q - 1, recording the expected key.
    fn publish(&mut self, who: (&[u32], &Extras), table: &[u32], q: u32) {
        let (tokens, x) = who;
        let block = table[((q - 1) / self.s.block) as usize];
        let digest = self.digest(tokens, x, q);
        self.expect_stored.push((0, digest, Some(block)));
        let k = key(tokens, x, q);
        self.published.entry(k.clone()).or_default().insert(block);
        self.carried.entry(block).or_default().insert(k, digest);
    }

    /// Whether a checkpoint block is held anywhere the model knows of.
    fn ck_held(&self, block: u32) -> bool {
        self.ck.contains_key(&block)
            || self.seqs.values().chain(self.retired.values()).any(|s| {
                s.decode_tail.values().any(|t| t.0 == block)
                    || s.waiting.iter().any(|w| w.1 == block)
                    || s.steps.iter().any(|st| st.ckpts.iter().any(|c| c.1 == block))
            })
    }

    // --- operations ----------------------------------------------------------------------

    /// `add`: refused (`InvalidRequest`, nothing added) when the multimodal inputs are out of
    /// order; `extends` only shares work, never identity (the keys stay the sequence's own).
    fn add_seq(&mut self, tokens: Vec<u32>, x: Extras, extends: Option<u64>) -> Result<(), String> {
        self.next_id += 1;
        let id = self.next_id;
        let r = self.m.add(id, &tokens, x.core(), extends);
        if !x.in_order() {
            ensure!(kind(&r) == "InvalidRequest", "add {id} with {:?}: {r:?}", x.mm);
            self.saw("multimodal inputs out of order refused");
            return Ok(());
        }
        r.map_err(|e| format!("add {id}: {e}"))?;
        if !x.is_empty() {
            self.saw(if extends.is_some() {
                "added with extra keys, extends"
            } else {
                "added with extra keys"
            });
        }
        self.seqs.insert(
            id,
            Seq {
                id,
                tokens,
                x,
                table: Vec::new(),
                sw: Vec::new(),
                sw_view: Vec::new(),
                placeholders: 0,
                log: Vec::new(),
                committed: 0,
                started: false,
                steps: Vec::new(),
                deferred: BTreeSet::new(),
                retiring: None,
                committed_slot: BTreeMap::new(),
                extras: 0,
                prefill_target: 0,
                junction: None,
                resume: Vec::new(),
                decode_tail: BTreeMap::new(),
                waiting: Vec::new(),
            },
        );
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Add { stream, len, extra } => {
                let base = u32::from(stream) * 1000;
                let mut tokens: Vec<u32> = (base..base + u32::from(len)).collect();
                if stream == 3 {
                    tokens.push(self.fresh());
                }
                // (streams 0 and 1 carry none: their prompts share prefixes as before)
                let mut x = if stream < 2 {
                    Extras::default()
                } else {
                    Extras::of(extra, tokens.len() as u32)
                };
                if extra < 128 {
                    x.mm.sort_unstable_by_key(|m| (m.0, m.1));
                }
                self.add_seq(tokens, x, None)
            }
            Op::Fork { pick, cut, fresh, unknown, change, extends } => {
                self.fork(pick, cut, fresh, unknown, (change, extends))
            }
            Op::Lookup { pick } => {
                if let Some(id) = self.pick(pick) {
                    let pending = (!self.plans.is_empty()).then(|| self.pending());
                    self.check_lookup(id, pending.as_ref())?;
                }
                Ok(())
            }
            Op::Schedule { pick, budget } => match self.pick(pick) {
                Some(id) => self.schedule(id, u32::from(budget)),
                None => Ok(()),
            },
            Op::Build => self.build(),
            Op::Commit { which } => self.end(which, false),
            Op::Abort { which } => self.end(which, true),
            Op::Placeholders { pick, count } => match self.pick(pick) {
                Some(id) => self.placeholders(id, u32::from(count)),
                None => Ok(()),
            },
            Op::Resolve { pick, count } => match self.pick(pick) {
                Some(id) => self.resolve(id, u32::from(count)),
                None => Ok(()),
            },
            Op::Append { pick, count } => match self.pick(pick) {
                Some(id) => self.append(id, u32::from(count)),
                None => Ok(()),
            },
            Op::Finish { pick } => match self.pick(pick) {
                Some(id) => self.release(id, Retire::Finish),
                None => Ok(()),
            },
            Op::Preempt { pick } => match self.pick(pick) {
                Some(id) => self.release(id, Retire::Preempt),
                None => Ok(()),
            },
            Op::Round => self.round(),
            Op::FastRound => self.fast_round(),
            Op::Turn { pick, fresh } => self.turn(pick, fresh),
            Op::Decode { rounds } => {
                for _ in 0..rounds {
                    self.round()?;
                    self.check_all()?;
                }
                Ok(())
            }
            Op::Request { pick, position } => self.request(pick, position),
            Op::Ahead { pick, count } => self.ahead(pick, count),
        }
    }

    /// `request_checkpoint`. Its rule, stated here: allowed (at D = 1 only with no plan in
    /// flight) for a sequence whose newest step waits for the next plan, continuations deeper
    /// in flight included; with a state group, a position p of that step's chunk `(qs, qe]`
    /// that is a unit boundary (alignment 1: every one is exportable) is recorded once, and
    /// anything else is an `Alignment` error; without one, `InvalidRequest`. The plan then
    /// considers the requested positions first, in request order (section 4).
    fn request(&mut self, pick: u8, position: u8) -> Result<(), String> {
        let waiting: Vec<u64> = self
            .seqs
            .values()
            .filter(|s| s.steps.last().is_some_and(|st| st.plan == 0))
            .map(|s| s.id)
            .collect();
        let id = match waiting.get(usize::from(pick) % waiting.len().max(1)) {
            Some(&id) => id,
            None => match self.pick(pick) {
                // (scheduled first, mostly: a request needs a step waiting for the plan)
                Some(id) if position % 8 != 0 => {
                    let seq = &self.seqs[&id];
                    let mut budget = 1 + u32::from(position) % 9;
                    if seq.started && seq.planned() >= seq.len() && !self.classic_busy() {
                        // decoding: a step of one to U placeholders (its end is a unit
                        // boundary a quarter of the time)
                        budget = 1 + u32::from(position / 8) % U;
                        self.placeholders(id, budget)?;
                    }
                    self.schedule(id, budget)?;
                    self.check_all()?;
                    id
                }
                Some(id) => id,
                None => return Ok(()),
            },
        };
        let chunk =
            self.seqs[&id].steps.last().filter(|st| st.plan == 0).map(|st| (st.start, st.end));
        // (the unit boundaries of the chunk: its end, and interior ones on the grid from its
        // start)
        let grid = self.grid();
        let valid: Vec<u32> = chunk.map_or_else(Vec::new, |(s, e)| {
            (s / U + 1..=e / U).map(|i| i * U).filter(|p| *p == e || (p - s) % grid == 0).collect()
        });
        let seq = &self.seqs[&id];
        let cached = valid.iter().copied().find(|&p| {
            p as usize <= seq.tokens.len()
                && self.has_ck(&gkey(STATE, &seq.key(p)))
                && position % 2 == 1
        });
        let p = match chunk {
            // (a position whose prefix has a checkpoint already, when there is one: skipped)
            Some(_) if position < 200 && cached.is_some() => cached.unwrap_or_default(),
            // (an interior one mostly: it competes with the retained positions for C)
            Some((_, e)) if position < 200 && valid.len() > 1 && position % 4 != 0 => {
                let interior: Vec<u32> = valid.iter().copied().filter(|&p| p < e).collect();
                interior[usize::from(position) % interior.len()]
            }
            Some(_) if position < 200 && !valid.is_empty() => {
                valid[usize::from(position) % valid.len()]
            }
            Some((_, e)) => u32::from(position) % (e + U + 1),
            None => u32::from(position),
        };
        let r = self.m.request_checkpoint(id, p);
        let expect = if self.classic_busy() || chunk.is_none() {
            "Step"
        } else if self.s.state.is_none() {
            "InvalidRequest"
        } else if !valid.contains(&p) {
            "Alignment"
        } else {
            "ok"
        };
        ensure!(kind(&r) == expect, "request_checkpoint({id}, {p}): {r:?}, expected {expect}");
        if r.is_ok() {
            let seq = self.seqs.get_mut(&id).unwrap();
            let first = seq.steps.len() == 1;
            let decode =
                seq.steps.last().is_some_and(|st| !st.first && st.start >= seq.prefill_target);
            let step = seq.steps.last_mut().unwrap();
            if !step.requested.contains(&p) {
                step.requested.push(p);
            }
            if decode {
                self.saw("checkpoint requested in a decode step");
            }
            self.saw(if first {
                "checkpoint requested"
            } else {
                "checkpoint requested for a continuation"
            });
        } else if expect == "Alignment" {
            self.saw("checkpoint request off the grid refused");
        }
        Ok(())
    }

    /// `Op::Turn`: a conversation's next turn (its steps in flight commit, it finishes, its
    /// known tokens and more are added).
    fn turn(&mut self, pick: u8, fresh: u8) -> Result<(), String> {
        // Mostly a sequence holding a decode tail (its next turn may resume there).
        let tails: Vec<u64> =
            self.seqs.values().filter(|s| !s.decode_tail.is_empty()).map(|s| s.id).collect();
        let id = match tails.get(usize::from(pick) % tails.len().max(1)) {
            Some(&id) if pick % 4 != 0 => id,
            _ => match self.pick(pick) {
                Some(id) => id,
                None => return Ok(()),
            },
        };
        if self.classic_busy() {
            return Ok(());
        }
        // The next turn arrives after this one ended: its steps in flight commit first.
        while self.seqs[&id].steps.iter().any(|s| s.plan != 0) {
            self.end(0, false)?;
            self.check_all()?;
        }
        // (and the tokens they sampled are known)
        let unknown = self.seqs[&id].placeholders;
        if unknown > 0 {
            self.resolve(id, unknown)?;
        }
        let mut tokens = self.seqs[&id].tokens.clone();
        let mut x = self.seqs[&id].x.clone();
        self.release(id, Retire::Finish)?;
        self.check_all()?;
        let n = tokens.len() as u32;
        for _ in 0..fresh {
            tokens.push(self.fresh());
        }
        if pick % 3 == 0 {
            // (the new turn carries an image)
            x.mm.push((n, n + u32::from(fresh), 1 + pick % 3));
        }
        self.saw("next turn");
        self.add_seq(tokens, x, (pick % 2 == 0).then_some(id))
    }

    /// `Op::Ahead`: placeholders appended, scheduled in one chunk, planned and the oldest
    /// plan committed, their tokens still unknown.
    fn ahead(&mut self, pick: u8, count: u8) -> Result<(), String> {
        let Some(id) = self.pick(pick) else { return Ok(()) };
        if self.classic_busy() || self.plans.len() >= self.s.depth as usize {
            return Ok(());
        }
        self.placeholders(id, u32::from(count))?;
        self.schedule(id, u32::from(count))?;
        self.build()?;
        self.check_all()?;
        self.end(0, false)?;
        self.saw("placeholders computed ahead");
        Ok(())
    }

    /// `Op::Fork`: a prefix of a live sequence's known tokens, fresh ones, placeholders; the
    /// parent's extra keys (those within the new tokens), changed by `change.0`; `change.1`:
    /// `extends` names the parent.
    fn fork(
        &mut self,
        pick: u8,
        cut: u8,
        fresh: u8,
        unknown: u8,
        change: (u8, bool),
    ) -> Result<(), String> {
        let (change, extends) = change;
        let Some(id) = self.pick(pick) else { return Ok(()) };
        let known = self.seqs[&id].tokens.clone();
        let mut tokens = known[..=usize::from(cut) % known.len()].to_vec();
        for _ in 0..fresh {
            tokens.push(self.fresh());
        }
        let n = tokens.len() as u32;
        let mut x = self.seqs[&id].x.clone();
        x.mm.retain(|m| m.1 <= n);
        let v = u32::from(change >> 3);
        match change % 8 {
            4 => x.salt = if x.salt.is_some() { None } else { Some(0) },
            5 => x.lora = Some(x.lora.map_or(0, |l| l + 1)),
            6 if !x.mm.is_empty() => {
                let i = v as usize % x.mm.len();
                x.mm[i].2 = x.mm[i].2 % 3 + 1;
            }
            6 | 7 => {
                let start = v % n;
                x.mm.push((start, start + 1 + (v / 3) % (n - start), 1 + (v % 3) as u8));
                x.mm.sort_unstable_by_key(|m| (m.0, m.1));
            }
            _ => {}
        }
        if x != self.seqs[&id].x {
            self.saw("fork with different extra keys");
        }
        self.add_seq(tokens, x, extends.then_some(id))?;
        if unknown > 0 {
            self.placeholders(self.next_id, u32::from(unknown))?;
        }
        Ok(())
    }

    fn fresh(&mut self) -> u32 {
        self.next_token += 1;
        self.next_token
    }

    fn round(&mut self) -> Result<(), String> {
        if self.plans.len() >= self.s.depth as usize {
            self.end(0, false)?;
            self.check_all()?;
        }
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        for &id in &ids {
            let seq = &self.seqs[&id];
            if seq.started && seq.placeholders > 0 && seq.steps.iter().all(|s| s.plan != 0) {
                self.resolve(id, 1)?;
            }
        }
        if self.classic_busy() {
            return Ok(());
        }
        for &id in &ids {
            let seq = &self.seqs[&id];
            if seq.retiring.is_none() && seq.steps.len() < self.s.depth as usize {
                let decode = seq.started && seq.planned() >= seq.len();
                if decode {
                    self.placeholders(id, 1)?;
                }
                self.schedule(id, if decode { 1 } else { 8 })?;
            }
        }
        self.build()?;
        self.saw("overlapped round");
        Ok(())
    }

    /// `round` in one `decode_step_overlapped` call, where it must succeed: the oldest plan
    /// commits when D are in flight, one placeholder of each started sequence with one and no step
    /// waiting for the next plan is resolved, and each decoding sequence (started, every token
    /// planned, below D steps, not retiring, none waiting for the next plan) gets a placeholder
    /// and one token scheduled; the plan holds whatever else was scheduled before them.
    #[allow(clippy::too_many_lines)]
    fn fast_round(&mut self) -> Result<(), String> {
        let depth = self.s.depth as usize;
        if depth == 1 {
            return self.round();
        }
        let commit = (self.plans.len() >= depth).then(|| self.plans[0].0);
        if commit.is_some() {
            self.commit_oldest();
        }
        let ready = |s: &Seq| s.steps.iter().all(|st| st.plan != 0);
        let resolve: Vec<u64> = self
            .seqs
            .values()
            .filter(|s| s.started && s.placeholders > 0 && ready(s))
            .map(|s| s.id)
            .collect();
        let tokens: Vec<u32> = resolve.iter().map(|_| self.fresh()).collect();
        let decoding: Vec<u64> = self
            .seqs
            .values()
            .filter(|s| {
                s.started
                    && s.retiring.is_none()
                    && s.steps.len() < depth
                    && ready(s)
                    && s.planned() >= s.len()
            })
            .map(|s| s.id)
            .collect();
        let mut plan = prefixcache_core::StepPlan::default();
        // (the commit comes first, then the schedules: each takes free window blocks first)
        let sw_free = self.sw_room().map(|r| r.0);
        let mut sw_taken = 0;
        let r = self.m.decode_step_overlapped(commit, &resolve, &tokens, &decoding, &mut plan);
        self.take_removals(None)?;
        let sw_evicted = self.take_sw_removals(&[])?;
        let r = r.map_err(|e| format!("decode_step_overlapped: {e}"))?;
        for (&id, &t) in resolve.iter().zip(&tokens) {
            self.note_resolve(id, &[t]);
        }
        ensure!(r.len() == decoding.len(), "{} results for {} sequences", r.len(), decoding.len());
        for (&id, got) in decoding.iter().zip(r) {
            self.note_placeholders(id, 1);
            let start = self.seqs[&id].planned();
            let (pins, _, new_blocks) = self.fa_need(&self.seqs[&id], None, start + 1);
            let (_, _, sw_new) = self.sw_need(&self.seqs[&id], None, start + 1);
            let available = self.fa_available();
            // (decode steps pin nothing: the room is known when it was before)
            let sw_fits =
                self.sw_room().is_none_or(|(free, cached)| sw_new as usize <= free + cached);
            let fits = self.state_room(&self.seqs[&id], None)
                && available.is_none_or(|a| new_blocks as usize <= a)
                && sw_fits;
            let Some(got) = got else {
                ensure!(
                    !fits || available.is_none() || self.sw_room().is_none(),
                    "decode_step_overlapped refused {id} although the pools have room"
                );
                self.saw(if sw_fits {
                    "decode step refused: the state pool is short"
                } else {
                    "decode step refused: the sliding-window pool is short"
                });
                continue;
            };
            ensure!(sw_fits, "decode_step_overlapped scheduled {id}: the window pool is short");
            sw_taken += sw_new as usize;
            ensure!(
                fits || available.is_none(),
                "decode_step_overlapped scheduled {id} although the pool is short"
            );
            if self.s.state.is_some() && !self.seqs[&id].has_spare() {
                (0..self.n_states() as usize).for_each(|taken| self.take_state_block(taken));
                self.seqs.get_mut(&id).unwrap().extras += 1;
            }
            ensure!(
                got.seq_id == id
                    && got.num_computed == start
                    && got.num_tokens == 1
                    && got.hit.is_none(),
                "decode_step_overlapped scheduled {got:?}, expected [{start}, {})",
                start + 1
            );
            if self.seqs[&id].steps.iter().any(|s| s.plan != 0) {
                self.saw("continuation scheduled");
            }
            let table_before = self.seqs[&id].table.len();
            let seq = self.seqs.get_mut(&id).unwrap();
            seq.steps.push(Step {
                plan: 0,
                start,
                end: start + 1,
                first: false,
                slots: BTreeMap::new(),
                ckpts: Vec::new(),
                requested: Vec::new(),
                table_before,
                cow_src: None,
                pins,
                new_blocks,
                sw_before: 0,
                sw_cow: None,
                sw_pins: Vec::new(),
                sw_new,
            });
            self.unbuilt.push((false, id));
        }
        if let Some(free) = sw_free {
            let expected = sw_taken.saturating_sub(free);
            ensure!(
                sw_evicted == expected,
                "decode step evicted {sw_evicted} window blocks, not {expected}"
            );
        }
        self.saw("decode_step_overlapped");
        self.sync_fa_lru();
        self.check_built(&plan)
    }

    /// Whether the state pool has room for a schedule (`hit`: a first one's): a first step
    /// takes its running pair, and the checkpoint it resumes from leaves the cached ones; a
    /// continuation without a spare buffer takes one more.
    fn state_room(&self, seq: &Seq, hit: Option<u32>) -> bool {
        if self.s.state.is_none() {
            return true;
        }
        // (per state group of the pool)
        let need: usize = self
            .state_groups()
            .map(|g| match hit {
                Some(l) => {
                    let cached = l > 0
                        && self
                            .resume_choice(&gkey(g, &seq.key(l)))
                            .is_some_and(|b| self.ck[&b].pins == 0);
                    2 + usize::from(cached)
                }
                None => usize::from(!seq.has_spare()),
            })
            .sum();
        need <= self.available()
    }

    #[allow(clippy::too_many_lines)]
    fn schedule(&mut self, id: u64, budget: u32) -> Result<(), String> {
        let depth = self.s.depth as usize;
        let seq = self.seqs[&id].clone();
        let expect = if self.classic_busy()
            || seq.steps.last().is_some_and(|s| s.plan == 0)
            || seq.steps.len() >= depth
            || seq.retiring.is_some()
        {
            "Step"
        } else if seq.planned() >= seq.len() {
            "NothingToSchedule"
        } else {
            "ok"
        };
        let first = !seq.started;
        let pending = (!self.plans.is_empty()).then(|| self.pending());
        let hit = first.then(|| self.expected_hit(&seq, pending.as_ref()));
        let start = hit.as_ref().map_or_else(|| seq.planned(), |h| h.tokens);
        let mut end = (start + budget).min(seq.len());
        if end < seq.len() {
            // (a chunk short of the end is trimmed to the grid; nothing may be left of it)
            let trimmed = (end / self.grid() * self.grid()).max(start);
            if trimmed < end && trimmed > start {
                self.saw("a chunk trimmed to the grid");
            }
            end = trimmed;
        }
        // (a schedule of 0 tokens takes nothing and is never refused)
        let zero = end == start && expect == "ok";
        if zero {
            self.saw("a chunk trimmed to nothing");
        }
        let (pins, extra, new_blocks) = self.fa_need(&seq, hit.as_ref().map(|h| h.tokens), end);
        let (sw_pins, sw_extra, sw_new) = self.sw_need(&seq, hit.as_ref().map(|h| h.tokens), end);
        let sw_room = self.sw_room();
        let r = self.m.schedule(id, budget, 0, false);
        let allocates = matches!(r, Ok(Some(_)) if !zero).then_some((&pins[..], new_blocks));
        self.take_removals(allocates)?;
        // (a refused schedule evicts nothing; an accepted one what its new blocks need)
        let accepted = matches!(r, Ok(Some(_))) && !zero;
        let evicted = self.take_sw_removals(&sw_pins)?;
        if let Some((free, _)) = sw_room {
            let expected = if accepted { (sw_new as usize).saturating_sub(free) } else { 0 };
            ensure!(
                evicted == expected,
                "schedule {id} evicted {evicted} window blocks, not {expected}"
            );
        }
        ensure!(kind(&r) == expect, "schedule {id}: {r:?}, expected {expect}");
        let Ok(r) = r else {
            self.saw("schedule refused");
            return Ok(());
        };
        if zero {
            let r = r.ok_or_else(|| format!("schedule {id} of 0 tokens refused"))?;
            ensure!(
                r.num_computed == start && r.num_tokens == 0 && r.hit == hit,
                "schedule {id}: {r:?}, expected 0 tokens at {start} (hit {hit:?})"
            );
            return Ok(());
        }
        let state_fits = self.state_room(&seq, hit.as_ref().map(|h| h.tokens));
        let available = self.fa_available();
        let fa_fits = available.is_none_or(|a| extra + new_blocks as usize <= a);
        let sw_fits =
            sw_room.is_none_or(|(free, cached)| (sw_extra + sw_new) as usize <= free + cached);
        let fits = state_fits && fa_fits && sw_fits;
        let Some(r) = r else {
            ensure!(
                !fits || available.is_none() || sw_room.is_none(),
                "schedule {id} refused although the pools have room (window: {sw_extra} pins \
                 of cached blocks and {sw_new} new, (free, cached) {sw_room:?}; held {:?}; \
                 usage {:?})",
                self.sw_owned(),
                self.m.pool_usage()
            );
            self.saw(if !sw_fits && state_fits && fa_fits {
                "schedule refused: the sliding-window pool is short"
            } else if state_fits {
                "schedule refused: the full-attention pool is short"
            } else {
                "schedule refused: the state pool is short"
            });
            return Ok(());
        };
        ensure!(sw_fits, "schedule {id} succeeded although the sliding-window pool is short");
        if sw_room.is_some_and(|(free, _)| sw_new as usize > free) {
            self.saw("a schedule evicted window blocks");
        }
        ensure!(
            fits || !state_fits || available.is_none(),
            "schedule {id} succeeded although the {} pool is short",
            if state_fits { "full-attention" } else { "state" }
        );
        ensure!(r.hit == hit, "schedule {id}: hit\n  got      {:?}\n  expected {hit:?}", r.hit);
        ensure!(
            r.num_computed == start && r.num_tokens == end - start,
            "schedule {id}: {r:?}, expected [{start}, {end})"
        );
        if end == start {
            return Ok(());
        }
        if seq.steps.iter().any(|s| s.plan != 0) {
            self.saw("continuation scheduled");
        }
        let mut resume = Vec::new();
        if let Some(h) = &hit {
            // (every group's hit is pinned before any block is taken)
            for g in self.state_groups().filter(|_| start > 0) {
                let prefix = gkey(g, &seq.key(start));
                let block =
                    self.resume_choice(&prefix).ok_or("a state hit without a checkpoint")?;
                if self.ck.values().filter(|c| c.prefix == prefix).count() > 1 {
                    self.saw("resumed from one of several copies");
                }
                self.pin(block);
                resume.push(block);
                if self.ck[&block].since == 0 && self.ck[&block].decode_tail {
                    self.saw("a pinned decode tail leaves the LRU list");
                }
                self.want_of(g).hits += 1;
                self.saw("schedule resumed from a checkpoint");
                if self.ck[&block].decode_tail {
                    self.saw("schedule resumed from a decode tail");
                }
            }
            let committed = self.fa_bound(&seq, h.max_tokens, &BTreeMap::new());
            let committed = (committed >= h.tokens + 2 * U).then_some(committed);
            if h.junction.is_some() && h.junction != committed {
                self.saw("junction counted keys in flight");
            }
        }
        let n = self.n_states() as usize;
        if first {
            (0..2 * n).for_each(|taken| self.take_state_block(taken));
        } else if n > 0 && !self.seqs[&id].has_spare() {
            (0..n).for_each(|taken| self.take_state_block(taken));
            self.seqs.get_mut(&id).unwrap().extras += 1;
            self.saw("a continuation took a further running buffer");
        }
        let table_before = self.seqs[&id].table.len();
        let seq = self.seqs.get_mut(&id).unwrap();
        if let Some(h) = hit {
            seq.started = true;
            seq.extras = 0;
            seq.committed = start;
            seq.prefill_target = seq.len();
            seq.junction = h.junction;
            seq.resume = resume;
        }
        seq.steps.push(Step {
            plan: 0,
            start,
            end,
            first,
            slots: BTreeMap::new(),
            ckpts: Vec::new(),
            requested: Vec::new(),
            table_before,
            cow_src: None,
            pins,
            new_blocks,
            sw_before: 0,
            sw_cow: None,
            sw_pins,
            sw_new,
        });
        self.unbuilt.push((false, id));
        self.sync_fa_lru();
        Ok(())
    }

    /// The checkpoints a step asks for, in priority order (position, decode tail), and the
    /// positions it skips by reason, before any block is taken.
    fn predict(
        &self,
        g: u32,
        seq: &Seq,
        step: &Step,
        available: usize,
    ) -> (Vec<(u32, bool)>, [u64; 5]) {
        let st = self.st(g);
        let (start, end) = (step.start, step.end);
        let mut skips = [0u64; 5];
        let mut wanted: Vec<(u32, bool)> = Vec::new();
        let inside = (start / U + 1..=end / U).map(|i| i * U);
        // Requested positions come first, whatever the step.
        wanted.extend(step.requested.iter().map(|&p| (p, false)));
        if !step.first && start >= seq.prefill_target {
            if st.decode_tail {
                let asked = |p: u32| step.requested.contains(&p);
                skips[MID_STEP] += inside.filter(|&p| p < end && !asked(p)).count() as u64;
                if end % U == 0 && !asked(end) {
                    wanted.push((end, true));
                }
            }
        } else {
            let tail = st.tail.then(|| (seq.prefill_target - 1) / U * U);
            let junction = seq.junction.filter(|_| st.junction);
            let intervals: Vec<u32> = match st.interval {
                Some(k) => inside.filter(|p| p % k == 0).rev().collect(),
                None => Vec::new(),
            };
            for p in tail.into_iter().chain(junction).chain(intervals) {
                if p > start && p <= end && !wanted.iter().any(|w| w.0 == p) {
                    wanted.push((p, false));
                }
            }
        }
        let known = seq.tokens.len() as u32;
        let limit = st.per_step.map_or(usize::MAX, |c| c as usize);
        let (mut planned, mut interior) = (Vec::new(), 0);
        for (p, decode_tail) in wanted {
            if p <= known && self.has_ck(&gkey(g, &seq.key(p))) {
                skips[ALREADY_CACHED] += 1;
            } else if p != end && (p - start) % st.alignment != 0 {
                // (only a chunk off the grid, a decode-phase one, has such interior positions)
                skips[UNALIGNED] += 1;
            } else if p != end && interior >= limit {
                skips[CAPACITY] += 1;
            } else if planned.len() >= available {
                // (no more blocks than the pool has free or cached now: it still counts for C)
                interior += usize::from(p != end);
                skips[BUDGET] += 1;
            } else {
                interior += usize::from(p != end);
                planned.push((p, decode_tail));
            }
        }
        (planned, skips)
    }

    fn build(&mut self) -> Result<(), String> {
        let refused = self.classic_busy() || self.plans.len() >= self.s.depth as usize;
        let r = self.m.build_plan();
        ensure!(kind(&r) == if refused { "Step" } else { "ok" }, "build_plan: {r:?}");
        let Ok(plan) = r else {
            self.saw("build_plan refused at D");
            return Ok(());
        };
        self.check_built(&plan)
    }

    /// A plan just built against the sequences scheduled for it (rows, chunks, state slots,
    /// checkpoints, whose blocks it takes).
    fn check_built(&mut self, plan: &prefixcache_core::StepPlan) -> Result<(), String> {
        let id = self.next_plan;
        self.next_plan += 1;
        ensure!(plan.step_id == id, "plan id {} expected {id}", plan.step_id);
        let rows = std::mem::take(&mut self.unbuilt);
        let ids: Vec<u64> = rows.iter().map(|&k| self.seq_ref(k).id).collect();
        ensure!(plan.seq_ids == ids, "plan rows {:?} expected {ids:?}", plan.seq_ids);
        for (row, &key) in rows.iter().enumerate() {
            let seq = self.seq_ref(key).clone();
            let step = seq.steps.last().ok_or("a plan row without a step")?.clone();
            ensure!(
                plan.num_computed[row] as u32 == step.start
                    && plan.num_scheduled[row] as u32 == step.end - step.start,
                "row {row}: [{}, +{}) expected [{}, {})",
                plan.num_computed[row],
                plan.num_scheduled[row],
                step.start,
                step.end
            );
            // (the state groups in order: each takes its blocks after the one before)
            let (mut slots, mut ckpts) = (BTreeMap::new(), Vec::new());
            for g in self.state_groups() {
                let (pair, mut taken) =
                    self.check_state_row(plan, (row, g), &seq, &step, &ckpts)?;
                ensure!(
                    slots.values().all(|&(_, r): &(i32, i32)| r != pair.1),
                    "row {row}: two state groups write running buffer {}",
                    pair.1
                );
                slots.insert(g, pair);
                ckpts.append(&mut taken);
            }
            let (table, cow_src) = self.check_table_row(plan, row, &seq, &step)?;
            let window = if self.s.window.is_some() {
                Some(self.check_sw_row(plan, row, &seq, &step)?)
            } else {
                None
            };
            let seq = self.seq_mut(key);
            seq.table = table;
            let sw_before = seq.sw.len();
            if let Some((sw, view, _)) = &window {
                (seq.sw, seq.sw_view) = (sw.clone(), view.clone());
            }
            let step = seq.steps.last_mut().ok_or("no step")?;
            if let Some((_, _, cow)) = window {
                step.sw_before = if step.first { 0 } else { sw_before };
                step.sw_cow = cow;
            }
            step.plan = id;
            step.slots = slots;
            step.ckpts = ckpts;
            step.cow_src = cow_src;
            step.pins.clear();
            step.new_blocks = 0;
            step.sw_pins.clear();
            step.sw_new = 0;
        }
        self.plans.push_back((id, rows));
        if self.plans.len() > 1 {
            self.saw("several plans in flight");
        }
        self.sync_fa_lru();
        Ok(())
    }

    /// A row's state slots and checkpoints against the model; takes the blocks (evicting at
    /// the cap) and counts the skips. Returns (initial, running) and the checkpoints.
    #[allow(clippy::type_complexity, clippy::too_many_lines)]
    fn check_state_row(
        &mut self,
        plan: &prefixcache_core::StepPlan,
        (row, g): (usize, u32),
        seq: &Seq,
        step: &Step,
        earlier: &[StepCk],
    ) -> Result<((i32, i32), Vec<StepCk>), String> {
        let sp = &plan.state[(g - STATE) as usize];
        ensure!(sp.group == g, "state plans out of order: {} for group {g}", sp.group);
        let (initial, running) = (sp.initial_slot[row], sp.running_slot[row]);
        let built = || seq.steps.iter().filter(|s| s.plan != 0);
        let slot_of = |s: &Step| s.slots.get(&g).map(|x| x.1);
        let others: Vec<i32> = built().filter_map(slot_of).collect();
        let expected = if step.first {
            let resume = seq.resume.iter().find(|b| self.ck[b].prefix[0] == g);
            resume.map_or(-1, |&b| b as i32)
        } else {
            let prev = built()
                .next_back()
                .and_then(slot_of)
                .or_else(|| seq.committed_slot.get(&g).copied());
            prev.ok_or("a continuation with no state to read")?
        };
        ensure!(
            initial == expected,
            "row {row} reads {initial}, expected {expected} (first: {})",
            step.first
        );
        ensure!(
            running > 0 && running != initial && !others.contains(&running),
            "row {row} writes {running}, used by another step or read"
        );
        if !others.is_empty() {
            self.saw("deep step chained its running state");
        }
        // What the plan wrote for the row: interior (offset, slot) pairs, then a snapshot of
        // its running buffer after the step.
        let cmax = sp.max_checkpoints;
        let mut written: BTreeMap<u32, u32> = BTreeMap::new();
        let offsets = &sp.checkpoint_offsets[row * cmax..(row + 1) * cmax];
        let blocks = &sp.checkpoint_slots[row * cmax..(row + 1) * cmax];
        let mut last = step.start;
        for (&o, &slot) in offsets.iter().zip(blocks) {
            if o == 0 && slot == -1 {
                continue;
            }
            let p = step.start + o as u32;
            ensure!(
                o > 0 && p < step.end && p > last && slot > 0,
                "row {row}: interior checkpoints {offsets:?} {blocks:?} for [{}, {})",
                step.start,
                step.end
            );
            last = p;
            written.insert(p, slot as u32);
        }
        for pair in sp.snapshots.chunks(2).filter(|pair| pair[0] == running) {
            ensure!(written.insert(step.end, pair[1] as u32).is_none(), "two at {}", step.end);
        }
        let taken = earlier.len();
        let (planned, skips) = self.predict(g, seq, step, self.available() - taken);
        if skips[BUDGET] > 0 {
            self.saw("checkpoints beyond what the pool holds skipped");
        }
        for (total, n) in self.want_of(g).skipped.iter_mut().zip(skips) {
            *total += n;
        }
        if skips[ALREADY_CACHED] > 0 {
            self.saw("skip already_cached");
        }
        if skips[CAPACITY] > 0 {
            self.saw("skip capacity");
        }
        if skips[UNALIGNED] > 0 {
            self.saw("skip unaligned");
        }
        if skips[MID_STEP] > 0 {
            self.saw("skip mid_step");
        }
        let cap = self.st(g).cap;
        let mut ckpts: Vec<StepCk> = Vec::new();
        for (p, decode_tail) in planned {
            // Running sequences keep the reserve: each state group of the pool promised them
            // its own, and a further buffer per step deeper in flight in every state group of
            // the pool; a checkpoint of any group must keep every group's promise.
            let further = (self.s.depth as usize - 1) * self.n_states() as usize;
            let left = self.available() - taken - ckpts.len();
            let fits = (0..self.n_states() as usize).all(|h| {
                let promised = self.s.state.as_ref().map_or(0, |st| st.reserves[h]);
                left > (promised as usize + further) * self.started()
            });
            // (the cap counts the group's own, and beyond it the group evicts its own)
            let at_cap = cap.is_some_and(|c| self.ck_blocks(Some(g)) + ckpts.len() >= c as usize);
            let victim = if at_cap {
                self.lru
                    .iter()
                    .copied()
                    .find(|b| self.ck[b].prefix[0] == g && (!decode_tail || self.ck[b].decode_tail))
            } else {
                None
            };
            let block = written.remove(&p);
            let take = fits && (!at_cap || victim.is_some());
            ensure!(
                take == block.is_some(),
                "row {row}: checkpoint at {p} (decode tail {decode_tail}) {}, {} blocks of cap \
                 {cap:?}, LRU {:?}",
                if take { "skipped, expected taken" } else { "taken, expected skipped (budget)" },
                self.ck_blocks(Some(g)) + ckpts.len(),
                self.lru
            );
            let Some(block) = block else {
                self.want_of(g).skipped[BUDGET] += 1;
                self.saw(if fits {
                    "cap skipped a checkpoint with nothing to evict"
                } else {
                    "the reserve skipped a checkpoint"
                });
                continue;
            };
            if !at_cap {
                self.take_state_block(taken + ckpts.len());
            }
            if let Some(v) = victim {
                if self.lru.iter().any(|b| self.ck[b].prefix[0] != g) {
                    self.saw("cap evicted its group's checkpoint, another group's older");
                }
                self.saw(if self.ck[&v].decode_tail {
                    "cap evicted a decode tail"
                } else if self.lru.len() > 1 {
                    "cap evicted the least recently used of several"
                } else {
                    "cap evicted a checkpoint"
                });
                self.evict_ck(v);
            }
            ensure!(
                !self.ck_held(block)
                    && !ckpts.iter().chain(earlier).any(|c| c.1 == block)
                    && block as i32 != running
                    && block as i32 != initial,
                "row {row}: checkpoint block {block} at {p} is not a fresh block"
            );
            self.saw(match (decode_tail, p == step.end) {
                (true, _) => "decode-tail snapshot",
                (false, true) => "snapshot checkpoint",
                (false, false) => "interior checkpoint",
            });
            if seq.junction == Some(p) {
                self.saw("junction checkpoint");
            }
            if p > seq.tokens.len() as u32 {
                self.saw("checkpoint planned over a placeholder");
            }
            ckpts.push((p, block, decode_tail, g));
        }
        ensure!(
            written.is_empty(),
            "row {row} wrote checkpoints at {:?}, which the model does not ask for",
            written.keys().collect::<Vec<_>>()
        );
        ckpts.sort_unstable();
        Ok(((initial, running), ckpts))
    }

    fn end(&mut self, which: u8, abort: bool) -> Result<(), String> {
        let target = match which {
            0 => self.plans.front().map(|p| p.0),
            1 => self.plans.get(1).map(|p| p.0),
            _ => self.ended.last().copied(),
        };
        let Some(target) = target else { return Ok(()) };
        let oldest = self.plans.front().map(|p| p.0);
        let r = if abort {
            self.m.abort_step(target).map(Some)
        } else {
            self.m.commit_step(target).map(|()| None)
        };
        if which == 1 {
            let named = matches!(&r, Err(CacheError::Step { message }) if message.contains(&format!("step {}", oldest.unwrap())));
            ensure!(named, "ending the later plan {target}: {r:?}");
            self.saw("out-of-order end refused");
            return Ok(());
        }
        if which == 2 {
            ensure!(matches!(r, Err(CacheError::StalePlan { .. })), "stale {target}: {r:?}");
            self.saw("stale end refused");
            return Ok(());
        }
        let r = r.map_err(|e| format!("ending {target}: {e}"))?;
        if abort {
            let expected: Vec<u64> = self.plans.iter().map(|p| p.0).collect();
            ensure!(
                r.as_deref() == Some(&expected[..]),
                "abort returned {r:?}, expected {expected:?}"
            );
            if expected.len() > 1 {
                self.saw("cascading abort");
            }
            self.abort_all(target);
        } else {
            self.commit_oldest();
        }
        Ok(())
    }

    fn commit_oldest(&mut self) {
        let (id, rows) = self.plans.pop_front().unwrap();
        self.ended.push(id);
        for key in rows {
            let block = self.s.block;
            let mut seq = self.seq_mut(key).clone();
            let step = seq.steps.remove(0);
            debug_assert_eq!(step.plan, id);
            let known = seq.tokens.len() as u32;
            let mut stored = Vec::new();
            if step.first && step.start % block != 0 {
                // The copy-on-write destination is keyed for the boundaries it copied.
                let mut q = step.start / block * block + U;
                while q <= step.start {
                    stored.push(q);
                    q += U;
                }
            }
            // (the window's copy-on-write destination likewise, for its own block size)
            let mut sw_stored = Vec::new();
            if let Some((b, _)) = self.s.window.filter(|(b, _)| step.first && step.start % b != 0) {
                let mut q = step.start / b * b + U;
                while q <= step.start {
                    sw_stored.push(q);
                    q += U;
                }
            }
            let mut q = (step.start / U + 1) * U;
            while q <= step.end {
                if q <= known {
                    stored.push(q);
                    sw_stored.push(q);
                } else {
                    seq.deferred.insert(q);
                }
                q += U;
            }
            let (tokens, x, table) = (seq.tokens.clone(), seq.x.clone(), seq.table.clone());
            for q in stored {
                self.publish((&tokens, &x), &table, q);
            }
            let sw = seq.sw.clone();
            for q in sw_stored {
                self.publish_sw((&tokens, &x), &sw, q);
            }
            seq.committed = step.end;
            for (&g, &(_, running)) in &step.slots {
                seq.committed_slot.insert(g, running);
            }
            // Each state group in turn: the resume checkpoint first, then the step's own,
            // ascending.
            let resume = if step.first { std::mem::take(&mut seq.resume) } else { Vec::new() };
            let mut publish = Vec::new();
            for &(p, b, decode_tail, g) in &step.ckpts {
                if decode_tail {
                    if seq.decode_tail.insert(g, (b, p)).is_some() {
                        self.saw("a decode tail replaced the previous one");
                    }
                } else if p > known {
                    seq.waiting.push((g, b, p));
                    self.saw("checkpoint over a placeholder waits for its tokens");
                } else {
                    publish.push((g, p, b));
                }
            }
            *self.seq_mut(key) = seq;
            for g in self.state_groups() {
                let mine: Vec<u32> =
                    resume.iter().copied().filter(|b| self.ck[b].prefix[0] == g).collect();
                for b in mine {
                    self.unpin(b);
                }
                for &(_, p, b) in publish.iter().filter(|c| c.0 == g) {
                    self.publish_ck((&tokens, &x), (g, p), b, false);
                }
            }
            // (the window releases what it no longer reads once the step's keys are published)
            self.release_window(key);
            self.after_end(key);
        }
        self.sync_fa_lru();
    }

    fn abort_all(&mut self, oldest: u64) {
        let plans: Vec<_> = self.plans.drain(..).collect();
        let touched: Vec<(bool, u64)> = plans.iter().flat_map(|p| p.1.clone()).collect();
        for &key in &touched {
            if self.seq_mut(key).steps.last().is_some_and(|s| s.plan == 0) {
                self.unbuilt.retain(|&k| k != key);
                self.undo_newest(key);
            }
        }
        for (id, rows) in plans.iter().rev() {
            for &key in rows.iter().rev() {
                let seq = self.seq_mut(key);
                debug_assert_eq!(seq.steps.last().map(|s| s.plan), Some(*id));
                self.undo_newest(key);
            }
            self.ended.push(*id);
        }
        for &key in &touched {
            let seq = self.seq_mut(key);
            while let Some(&(stamp, n)) = seq.log.last() {
                if stamp < oldest {
                    break;
                }
                seq.placeholders -= n;
                seq.log.pop();
            }
        }
        for key in touched {
            self.after_end(key);
        }
        self.sync_fa_lru();
    }

    /// Undoes a sequence's newest step: what it planned is freed, and a first step releases
    /// the checkpoint it resumed from (most recently used).
    fn undo_newest(&mut self, key: (bool, u64)) {
        let b = self.s.block;
        let seq = self.seq_mut(key);
        let mut resume = Vec::new();
        let mut released = Vec::new();
        if let Some(step) = seq.steps.pop() {
            // (its blocks go back, tail first: the ones it took, and the table as it was
            // before it; not yet built, the hit blocks it pinned)
            if step.plan != 0 {
                released = seq.table.split_off(step.table_before);
                seq.sw.truncate(step.sw_before);
            } else if step.first {
                let boundaries = (step.start / b) as usize;
                released = step.pins.iter().take(boundaries).filter_map(|p| p.1).collect();
            }
            if step.first {
                seq.started = false;
                seq.committed = 0;
                seq.committed_slot.clear();
                seq.extras = 0;
                resume = std::mem::take(&mut seq.resume);
            }
        }
        released.reverse();
        self.fa_released.push(released);
        for b in resume {
            self.unpin(b);
            self.saw("an undone first step released its resume checkpoint");
        }
    }

    /// A released sequence's checkpoints: `finish` publishes its decode tail where its prefix
    /// is known (least recently used); what waits for tokens is dropped.
    fn release_checkpoints(&mut self, key: (bool, u64), finish: bool) {
        let seq = self.seq_mut(key);
        debug_assert!(seq.resume.is_empty());
        let tails = std::mem::take(&mut seq.decode_tail);
        let waiting = std::mem::take(&mut seq.waiting);
        let (tokens, x) = (seq.tokens.clone(), seq.x.clone());
        if !waiting.is_empty() {
            self.saw("checkpoints waiting for tokens dropped");
        }
        // (each state group in turn)
        for (g, (b, p)) in tails {
            if finish && p as usize <= tokens.len() {
                self.publish_ck((&tokens, &x), (g, p), b, true);
                self.saw("finish published the decode tail");
            } else if finish {
                self.saw("finish dropped a decode tail over a placeholder");
            }
        }
    }

    /// A sequence whose last step ended, finished or preempted meanwhile, is released.
    fn after_end(&mut self, key: (bool, u64)) {
        let exists =
            if key.0 { self.retired.contains_key(&key.1) } else { self.seqs.contains_key(&key.1) };
        if !exists {
            return;
        }
        let seq = self.seq_mut(key);
        if !seq.steps.is_empty() {
            return;
        }
        // Without steps it gives its extra running buffers back.
        seq.extras = 0;
        match seq.retiring.take() {
            None => {}
            Some(Retire::Finish) => {
                self.release_checkpoints(key, true);
                let seq = self.retired.remove(&key.1).expect("a retired sequence");
                self.fa_released.push(seq.table.into_iter().rev().collect());
                self.saw("finished sequence released at its last step");
            }
            Some(Retire::Preempt) => {
                self.release_checkpoints(key, false);
                let seq = self.seq_mut(key);
                let table = std::mem::take(&mut seq.table);
                seq.sw.clear();
                self.fa_released.push(table.into_iter().rev().collect());
                let seq = self.seq_mut(key);
                seq.started = false;
                seq.committed = 0;
                seq.committed_slot.clear();
                seq.deferred.clear();
                self.saw("preempted sequence released at its last step");
            }
        }
    }

    fn placeholders(&mut self, id: u64, count: u32) -> Result<(), String> {
        let r = self.m.append_placeholders(id, count);
        let expect = if self.classic_busy() { "Step" } else { "ok" };
        ensure!(kind(&r) == expect, "append_placeholders {id}: {r:?}");
        if r.is_ok() {
            self.note_placeholders(id, count);
        }
        Ok(())
    }

    /// Placeholders appended: stamped with the plan built last.
    fn note_placeholders(&mut self, id: u64, count: u32) {
        let stamp = self.next_plan - 1;
        let seq = self.seqs.get_mut(&id).unwrap();
        seq.placeholders += count;
        match seq.log.last_mut() {
            Some((s, n)) if *s == stamp => *n += count,
            _ => seq.log.push((stamp, count)),
        }
    }

    fn resolve(&mut self, id: u64, count: u32) -> Result<(), String> {
        let tokens: Vec<u32> = (0..count).map(|_| self.fresh()).collect();
        let r = self.m.resolve(id, &tokens);
        let seq = &self.seqs[&id];
        let expect = if count > seq.placeholders { "InvalidRequest" } else { "ok" };
        ensure!(kind(&r) == expect, "resolve {id} x{count}: {r:?}");
        if r.is_err() {
            self.saw("resolve beyond the placeholders refused");
            return Ok(());
        }
        self.note_resolve(id, &tokens);
        Ok(())
    }

    /// The oldest placeholders filled with `tokens`: what their commit left waiting for them
    /// is published (paged keys, then checkpoints in ascending position).
    fn note_resolve(&mut self, id: u64, tokens: &[u32]) {
        let count = tokens.len() as u32;
        let seq = self.seqs.get_mut(&id).unwrap();
        seq.placeholders -= count;
        let mut left = count;
        while left > 0 {
            let (_, n) = &mut seq.log[0];
            let used = left.min(*n);
            *n -= used;
            left -= used;
            if *n == 0 {
                seq.log.remove(0);
            }
        }
        seq.tokens.extend(tokens);
        let known = seq.tokens.len() as u32;
        let ready: Vec<u32> = seq.deferred.iter().copied().filter(|&q| q <= known).collect();
        for q in &ready {
            seq.deferred.remove(q);
        }
        let (now, still): (Waiting, Waiting) =
            std::mem::take(&mut seq.waiting).into_iter().partition(|w| w.2 <= known);
        seq.waiting = still;
        let (tokens, x, table) = (seq.tokens.clone(), seq.x.clone(), seq.table.clone());
        if !ready.is_empty() {
            self.saw("resolve published a committed key");
            if !x.is_empty() {
                self.saw("resolve published a key with extra keys");
            }
        }
        let sw = self.seqs[&id].sw.clone();
        for q in ready {
            self.publish((&tokens, &x), &table, q);
            if self.s.window.is_some() && !self.publish_sw((&tokens, &x), &sw, q) {
                self.saw("a waiting key of a released window block is not published");
            }
        }
        for (g, b, p) in now {
            self.publish_ck((&tokens, &x), (g, p), b, false);
            self.saw("resolve published a waiting checkpoint");
        }
    }

    fn append(&mut self, id: u64, count: u32) -> Result<(), String> {
        let tokens: Vec<u32> = (0..count).map(|_| self.fresh()).collect();
        let r = self.m.append(id, &tokens);
        let expect =
            if self.classic_busy() || self.seqs[&id].placeholders > 0 { "Step" } else { "ok" };
        ensure!(kind(&r) == expect, "append {id}: {r:?}");
        if r.is_ok() {
            self.seqs.get_mut(&id).unwrap().tokens.extend(tokens);
        }
        Ok(())
    }

    fn release(&mut self, id: u64, how: Retire) -> Result<(), String> {
        let r = match how {
            Retire::Finish => self.m.finish(id),
            Retire::Preempt => self.m.preempt(id),
        };
        ensure!(kind(&r) == if self.classic_busy() { "Step" } else { "ok" }, "{how:?} {id}: {r:?}");
        if r.is_err() {
            return Ok(());
        }
        if self.seqs[&id].steps.last().is_some_and(|s| s.plan == 0) {
            self.unbuilt.retain(|&k| k != (false, id));
            self.undo_newest((false, id));
        }
        let in_flight = !self.seqs[&id].steps.is_empty();
        match how {
            Retire::Finish => {
                if !in_flight {
                    self.release_checkpoints((false, id), true);
                }
                let mut seq = self.seqs.remove(&id).unwrap();
                if !in_flight {
                    self.fa_released.push(seq.table.iter().rev().copied().collect());
                }
                if in_flight {
                    seq.retiring = Some(Retire::Finish);
                    self.saw("finish with steps in flight");
                    // Retired sequences are keyed apart from live ids: the id may be reused.
                    self.next_retired += 1;
                    let key = self.next_retired;
                    for p in &mut self.plans {
                        for k in &mut p.1 {
                            if *k == (false, id) {
                                *k = (true, key);
                            }
                        }
                    }
                    self.retired.insert(key, seq);
                }
            }
            Retire::Preempt => {
                if in_flight {
                    self.seqs.get_mut(&id).unwrap().retiring = Some(Retire::Preempt);
                    self.saw("preempt with steps in flight");
                } else {
                    self.release_checkpoints((false, id), false);
                    let seq = self.seqs.get_mut(&id).unwrap();
                    let table = std::mem::take(&mut seq.table);
                    seq.sw.clear();
                    self.fa_released.push(table.into_iter().rev().collect());
                    let seq = self.seqs.get_mut(&id).unwrap();
                    seq.started = false;
                    seq.committed = 0;
                    seq.committed_slot.clear();
                    seq.extras = 0;
                    seq.deferred.clear();
                }
            }
        }
        self.sync_fa_lru();
        Ok(())
    }

    fn check_lookup(
        &mut self,
        id: u64,
        pending: Option<&(Overlay, Overlay)>,
    ) -> Result<(), String> {
        let hit = self.m.lookup(id).map_err(|e| e.to_string())?;
        let seq = &self.seqs[&id];
        let expected = self.expected_hit(seq, pending);
        ensure!(hit == expected, "lookup {id}:\n  got      {hit:?}\n  expected {expected:?}");
        let waits_for_state = self.s.state.is_some()
            && hit.pending_plan.is_some()
            && !self.has_ck(&gkey(STATE, &seq.key(hit.pending_tokens)));
        let extras = !seq.x.is_empty();
        if hit.pending_plan.is_some() {
            self.saw("pending hit");
        }
        if extras && hit.tokens > 0 {
            self.saw("hit with extra keys");
        }
        if extras && hit.pending_plan.is_some() {
            self.saw("pending hit with extra keys");
        }
        if waits_for_state {
            self.saw("pending hit waits for a checkpoint in flight");
        }
        if hit.tokens > 0 && self.s.state.is_some() {
            self.saw("checkpoint hit");
        }
        Ok(())
    }

    fn check_all(&mut self) -> Result<(), String> {
        self.m.check_invariants().map_err(|e| e.to_string())?;
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        let pending = (!self.plans.is_empty()).then(|| self.pending());
        for id in ids {
            // A waiting sequence's lookup is left to the traffic now and then, so that a
            // schedule after plans changed is compared against a hit it computes itself.
            if self.seqs[&id].started || self.s.watch {
                self.check_lookup(id, pending.as_ref())?;
            }
            let seq = &self.seqs[&id];
            let got = (
                self.m.num_computed(id).unwrap(),
                self.m.num_tokens(id).unwrap(),
                self.m.num_placeholders(id).unwrap(),
            );
            let want = (if seq.started { seq.committed } else { 0 }, seq.len(), seq.placeholders);
            ensure!(
                got == want,
                "sequence {id}: (computed, len, placeholders) {got:?}, expected {want:?}"
            );
        }
        let flying: Vec<u64> = self.plans.iter().map(|p| p.0).collect();
        ensure!(
            self.m.plans_in_flight() == flying,
            "plans in flight {:?}, expected {flying:?}",
            self.m.plans_in_flight()
        );
        self.check_events()?;
        self.check_sw_pool()?;
        let stats = self.m.stats();
        if self.s.state.is_some() {
            let usage = self.m.pool_usage()[STATE as usize];
            let blocks = self.ck_blocks(None);
            ensure!(
                usage.checkpoints as usize == blocks && usage.cached as usize == self.lru.len(),
                "state pool {usage:?}: the model holds {blocks} checkpoint blocks, {} unpinned \
                 published ones",
                self.lru.len()
            );
            for g in self.state_groups() {
                let blocks = self.ck_blocks(Some(g));
                let cap = self.st(g).cap;
                ensure!(
                    cap.is_none_or(|c| blocks <= c as usize),
                    "group {g}: {blocks} beyond its cap"
                );
            }
            ensure!(
                (usage.free + usage.cached) as usize == self.available(),
                "state pool {usage:?}: the model has {} blocks free or cached",
                self.available()
            );
            for (g, want) in self.state_groups().zip(&self.want) {
                let s = &stats.groups[g as usize];
                let got = CkStats {
                    published: s.checkpoints_published,
                    decode_tails: s.decode_tails_published,
                    skipped: s.checkpoints_skipped,
                    hits: s.checkpoint_hits,
                    evictions: s.evictions,
                };
                ensure!(
                    got == *want,
                    "group {g}: checkpoint statistics {got:?}, expected {want:?}"
                );
            }
        }
        let ck_evictions: u64 = self.want.iter().map(|w| w.evictions).sum();
        ensure!(
            stats.evictions == ck_evictions + self.fa_evictions + self.sw_evictions,
            "{} evictions",
            stats.evictions
        );
        let usage = self.m.pool_usage()[0];
        if self.fuzzy() {
            self.saw("full-attention counts not checked: a pin of one of several copies");
        }
        if let Some(available) = self.fa_available() {
            let held = self.owned_ids();
            let owned = self.s.fa_blocks as usize - 1 - available;
            let cached = self.carried.keys().filter(|b| !held.contains(b)).count();
            ensure!(
                usage.owned as usize == owned && usage.cached as usize == cached,
                "full-attention pool {usage:?}: the model holds {owned} blocks, {cached} cached \
                 (tables {:?})",
                self.seqs
                    .values()
                    .chain(self.retired.values())
                    .map(|s| (s.id, s.table.clone(), s.steps.len()))
                    .collect::<Vec<_>>()
            );
        }
        Ok(())
    }

    /// The call's `BlockStored` keys and `BlockRemoved` checkpoints are exactly the expected.
    fn check_events(&mut self) -> Result<(), String> {
        let mut stored: Vec<Stored> = Vec::new();
        let mut removed: Vec<(u32, Digest, bool)> = Vec::new();
        self.take_removals(None)?;
        for event in std::mem::take(&mut self.drained) {
            match event {
                CacheEvent::BlockStored { group, keys, blocks, checkpoint, .. } => {
                    let state = self.state_groups().contains(&group);
                    ensure!(checkpoint == state, "checkpoint flag of group {group}");
                    for (k, b) in keys.into_iter().zip(blocks) {
                        stored.push((group, k, Some(b)));
                    }
                }
                CacheEvent::BlockRemoved { group, block, keys, gone } => {
                    ensure!(
                        self.state_groups().contains(&group)
                            && keys.len() == 1
                            && gone.iter().all(|g| keys.contains(g)),
                        "only checkpoints are evicted here: group {group} block {block} {keys:?}"
                    );
                    removed.push((block, keys[0], !gone.is_empty()));
                }
                CacheEvent::AllBlocksCleared => return Err("nothing resets".into()),
            }
        }
        let mut expected = std::mem::take(&mut self.expect_stored);
        stored.sort();
        expected.sort();
        ensure!(
            stored == expected,
            "stored keys differ: got {} {stored:?}\n expected {} {expected:?}",
            stored.len(),
            expected.len()
        );
        let mut expected = std::mem::take(&mut self.expect_removed);
        removed.sort();
        expected.sort();
        ensure!(removed == expected, "evicted {removed:?}, expected {expected:?}");
        Ok(())
    }

    fn wind_down(&mut self) -> Result<(), String> {
        while !self.plans.is_empty() {
            self.end(0, false)?;
            self.check_all()?;
        }
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        for id in ids {
            self.release(id, Retire::Finish)?;
            self.check_all()?;
        }
        for (i, usage) in self.m.pool_usage().into_iter().enumerate() {
            ensure!(usage.owned == 0, "pool {i}: {} blocks still owned", usage.owned);
        }
        if self.s.state.is_some() {
            let usage = self.m.pool_usage()[STATE as usize];
            ensure!(
                usage.cached as usize == self.ck.len()
                    && usage.checkpoints as usize == self.ck.len(),
                "state pool after finishing everything: {usage:?}, {} published",
                self.ck.len()
            );
        }
        Ok(())
    }
}

/// The digests in ascending order (an evicted block's keys against those the model says it
/// carries, whatever order either lists them in).
fn sorted(digests: impl IntoIterator<Item = Digest>) -> Vec<Digest> {
    let mut out: Vec<Digest> = digests.into_iter().collect();
    out.sort_unstable();
    out
}

fn run(setup: &Setup, ops: &[Op]) -> Result<BTreeMap<&'static str, u64>, String> {
    let mut model = Model::new(setup.clone());
    for (i, op) in ops.iter().enumerate() {
        model.apply(op).map_err(|e| format!("op {i} {op:?}: {e}"))?;
        model.check_all().map_err(|e| format!("after op {i} {op:?}: {e}"))?;
    }
    model.wind_down().map_err(|e| format!("winding down: {e}"))?;
    Ok(model.seen.into_inner())
}

/// Cases: 256 by default, or `PROPTEST_CASES` (`make fuzz` passes `MODEL_CASES` there), or
/// `MODEL_CASES` itself.
fn cases() -> u32 {
    ["PROPTEST_CASES", "MODEL_CASES"]
        .iter()
        .find_map(|v| std::env::var(v).ok().and_then(|v| v.parse().ok()))
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 4096, ..ProptestConfig::default() })]

    #[test]
    fn prop_overlapped_steps_follow_the_model(setup in setup(), ops in prop::collection::vec(op(), 1..60)) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases() / 2, max_shrink_iters: 4096, ..ProptestConfig::default() })]

    /// The same traffic with two state groups sharing the state pool.
    #[test]
    fn prop_overlapped_shared_state_pool_follows_the_model(setup in shared_state_setup(), ops in prop::collection::vec(op(), 1..60)) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }

    /// The same traffic with a sliding-window group beside full attention (and the state
    /// group in three cases of four).
    #[test]
    fn prop_overlapped_sliding_windows_follow_the_model(setup in windowed_setup(), ops in prop::collection::vec(windowed_op(), 1..60)) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }
}

/// Runs `count` cases of a fixed sample, adding the paths they took to `seen`.
fn sample(
    runner: &mut proptest::test_runner::TestRunner,
    setups: &impl Strategy<Value = Setup>,
    ops: &impl Strategy<Value = Vec<Op>>,
    count: usize,
    seen: &mut BTreeMap<&'static str, u64>,
) {
    use proptest::strategy::ValueTree;
    for case in 0..count {
        let s = setups.new_tree(runner).unwrap().current();
        let o = ops.new_tree(runner).unwrap().current();
        match run(&s, &o) {
            Ok(paths) => paths.into_iter().for_each(|(p, n)| *seen.entry(p).or_default() += n),
            Err(e) => panic!("case {case} failed: {e}\n{s:?}\n{o:?}"),
        }
    }
}

/// What the random traffic must reach over a fixed sample: a generator that stopped reaching
/// these would still pass without testing them.
#[test]
fn overlapped_traffic_reaches_every_path() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut seen: BTreeMap<&'static str, u64> = BTreeMap::new();
    let ops = prop::collection::vec(op(), 20..60);
    sample(&mut runner, &setup(), &ops, 240, &mut seen);
    // (and samples with a sliding-window group and with two state groups in one pool, after
    // the first so as not to change it)
    let ops = prop::collection::vec(windowed_op(), 20..60);
    sample(&mut runner, &windowed_setup(), &ops, 120, &mut seen);
    sample(&mut runner, &shared_state_setup(), &ops, 60, &mut seen);
    let want = [
        "overlapped round",
        "decode_step_overlapped",
        "continuation scheduled",
        "several plans in flight",
        "build_plan refused at D",
        "out-of-order end refused",
        "stale end refused",
        "cascading abort",
        "resolve published a committed key",
        "resolve beyond the placeholders refused",
        "finish with steps in flight",
        "preempt with steps in flight",
        "finished sequence released at its last step",
        "preempted sequence released at its last step",
        "pending hit",
        "deep step chained its running state",
        "schedule refused",
        // checkpoints
        "interior checkpoint",
        "snapshot checkpoint",
        "decode-tail snapshot",
        "junction checkpoint",
        "junction counted keys in flight",
        "checkpoint planned over a placeholder",
        "checkpoint over a placeholder waits for its tokens",
        "resolve published a waiting checkpoint",
        "checkpoints waiting for tokens dropped",
        "a decode tail replaced the previous one",
        "finish published the decode tail",
        "finish dropped a decode tail over a placeholder",
        "schedule resumed from a checkpoint",
        "schedule resumed from a decode tail",
        "resumed from one of several copies",
        "a second copy of a checkpoint published",
        "an undone first step released its resume checkpoint",
        "checkpoint hit",
        "pending hit waits for a checkpoint in flight",
        "skip already_cached",
        "skip capacity",
        "skip mid_step",
        "cap evicted the least recently used of several",
        "cap evicted a decode tail",
        "cap skipped a checkpoint with nothing to evict",
        // the full-attention pool
        "full-attention block evicted",
        "schedule refused: the full-attention pool is short",
        "copy on write",
        "first step shared cached blocks",
        "a schedule evicted some of several cached blocks",
        "a hit pinned the most recent of several cached copies",
        "a hit pinned the copy in use of several",
        "an eviction took the least recently used of several",
        "an eviction took the tail of a released table first",
        // the sliding-window group
        "a window gap stops the sliding-window group",
        "a first step's window table starts with nulls",
        "window copy on write",
        "window blocks released at commit",
        "a plan reported a window release",
        "a waiting key of a released window block is not published",
        "placeholders computed ahead",
        "sliding-window block evicted",
        "a schedule evicted window blocks",
        "schedule refused: the sliding-window pool is short",
        // two state groups in one pool
        "a second state group published a checkpoint",
        "cap evicted its group's checkpoint, another group's older",
        "checkpoint requested",
        "checkpoint requested for a continuation",
        "checkpoint requested in a decode step",
        "checkpoint request off the grid refused",
        // extra keys
        "added with extra keys",
        "added with extra keys, extends",
        "fork with different extra keys",
        "multimodal inputs out of order refused",
        "resolve published a key with extra keys",
        "hit with extra keys",
        "pending hit with extra keys",
    ];
    if std::env::var_os("MODEL_PATHS").is_some() {
        eprintln!("{seen:#?}");
    }
    let missing: Vec<&str> = want.into_iter().filter(|p| !seen.contains_key(p)).collect();
    assert!(missing.is_empty(), "never reached: {missing:?}\nreached: {seen:?}");
}

/// A hit looked up before a finish changed which copy of its blocks is in use: schedule must
/// pin the copy the rule picks then (in use, else the most recently used), not the one the
/// earlier lookup saw. The shrunk case of a 20,000-case run (full attention only, D = 1).
#[test]
fn a_schedule_after_a_finish_picks_the_copy_in_use_then() {
    for (fa_blocks, watch) in [(1024, false), (1024, true), (14, false), (24, false), (40, false)] {
        let setup = Setup {
            depth: 1,
            block: 4,
            fa_blocks,
            state: None,
            watch,
            window: None,
            sw_blocks: 1024,
            states: 1,
            second: None,
        };
        let ops = [
            Op::Add { stream: 0, len: 1, extra: 0 },
            Op::Add { stream: 2, len: 4, extra: 48 },
            Op::Add { stream: 2, len: 13, extra: 88 },
            Op::Lookup { pick: 0 },
            Op::Round,
            Op::Fork { pick: 80, cut: 3, fresh: 1, unknown: 0, change: 64, extends: false },
            Op::Add { stream: 0, len: 1, extra: 0 },
            Op::Commit { which: 0 },
            Op::Lookup { pick: 128 },
            Op::Finish { pick: 96 },
            Op::Add { stream: 0, len: 1, extra: 0 },
            Op::Round,
        ];
        if let Err(e) = run(&setup, &ops) {
            panic!("fa_blocks {fa_blocks}, watch {watch}: {e}");
        }
    }
}
