//! `add_batch` against `add`: a batch of requests must leave the manager exactly as the same
//! requests added one by one, in order, would (results, digests, reuse among the batch's own
//! requests); a batch with a request `add` refuses must change nothing and return that
//! request's error. The digests are also checked against the chain of the tokens themselves
//! (`hash_prefix`), so a batch cannot agree with `add` by both being wrong.

mod common;

use common::full_attention;
use prefixcache_core::{
    hash_prefix, AddRequest, Added, CacheConfig, CacheError, CacheManager, ExtraKeys,
    HashAlgorithm, HashConfig, MultimodalInput, Result,
};
use proptest::prelude::*;

/// Ids the generated requests draw from (small, so that ids repeat and `extends` finds some).
const IDS: u64 = 24;

#[derive(Clone, Debug)]
struct Req {
    id: u64,
    tokens: Vec<u32>,
    extra: ExtraKeys,
    extends: Option<u64>,
}

fn config(algorithm: HashAlgorithm, unit: u32, live: bool) -> CacheConfig {
    let mut c = full_attention(16, unit, 4096);
    c.hash = HashConfig { algorithm, unit, ..HashConfig::default() };
    c.reuse_live_prefixes = live;
    c
}

/// A prompt: one of four shared heads (or none), cut to `head` tokens, then its own tail.
fn prompt() -> impl Strategy<Value = Vec<u32>> {
    (0u32..5, 0usize..3000, proptest::collection::vec(0u32..6, 0..40), 0usize..6000).prop_map(
        |(system, head, tail, spread)| {
            let mut t: Vec<u32> = if system == 4 {
                Vec::new()
            } else {
                (0..head as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ system).collect()
            };
            t.extend(&tail);
            // Long tails, so that batches reach the sizes at which threads start.
            t.extend((0..spread as u32).map(|i| i.wrapping_mul(40_503) ^ tail.len() as u32));
            t
        },
    )
}

fn extra() -> impl Strategy<Value = ExtraKeys> {
    prop_oneof![
        6 => Just(ExtraKeys::default()),
        1 => Just(ExtraKeys { cache_salt: Some(b"tenant".to_vec()), ..ExtraKeys::default() }),
        // Refused by `add` (an empty multimodal hash).
        1 => Just(ExtraKeys {
            multimodal: vec![MultimodalInput { start: 0, end: 4, hash: Vec::new() }],
            ..ExtraKeys::default()
        }),
    ]
}

fn request() -> impl Strategy<Value = Req> {
    (0..IDS, prompt(), extra(), proptest::option::of(0..IDS))
        .prop_map(|(id, tokens, extra, extends)| Req { id, tokens, extra, extends })
}

/// The same history on a fresh manager: sequences added, some finished (in the finished cache,
/// where `extends` finds them), some left live.
fn history(config: &CacheConfig, before: &[(Req, bool)]) -> CacheManager {
    let mut m = CacheManager::new(config.clone()).expect("valid configuration");
    for (r, finish) in before {
        if m.add(r.id, &r.tokens, r.extra.clone(), r.extends).is_ok() && *finish {
            m.finish(r.id).expect("finish");
        }
    }
    m
}

/// What a test can see of a manager: every id's digests and length, the finished cache's
/// size and the statistics.
fn observe(m: &CacheManager) -> impl PartialEq + std::fmt::Debug {
    let seqs: Vec<_> =
        (0..IDS).map(|id| (m.sequence_digests(id).map(<[_]>::to_vec), m.num_tokens(id))).collect();
    (seqs, m.num_sequences(), m.num_finished_cached(), m.stats())
}

fn batch_of(reqs: &[Req]) -> Vec<AddRequest<'_>> {
    reqs.iter()
        .map(|r| AddRequest {
            seq_id: r.id,
            tokens: &r.tokens,
            extra: r.extra.clone(),
            extends: r.extends,
        })
        .collect()
}

fn check(
    config: &CacheConfig,
    before: &[(Req, bool)],
    reqs: &[Req],
    threads: usize,
) -> std::result::Result<(), TestCaseError> {
    let mut one_by_one = history(config, before);
    let mut batched = history(config, before);
    let untouched = observe(&batched);
    let sequential: Vec<Result<Added>> =
        reqs.iter().map(|r| one_by_one.add(r.id, &r.tokens, r.extra.clone(), r.extends)).collect();
    let got = batched.add_batch(batch_of(reqs), threads);
    batched.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
    if let Some(first) = sequential.iter().position(Result::is_err) {
        // All or nothing: the first refused request's own error, and nothing admitted.
        let expected: CacheError = sequential[first].clone().unwrap_err();
        prop_assert_eq!(got, Err(expected));
        prop_assert_eq!(observe(&batched), untouched);
        return Ok(());
    }
    let expected: Vec<Added> = sequential.into_iter().map(Result::unwrap).collect();
    prop_assert_eq!(got, Ok(expected));
    prop_assert_eq!(observe(&batched), observe(&one_by_one));
    for r in reqs {
        let chain = hash_prefix(&config.hash, &r.tokens, &r.extra).expect("hashable");
        prop_assert_eq!(batched.sequence_digests(r.id).expect("live"), &chain[..]);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(32),
        ..ProptestConfig::default()
    })]

    #[test]
    fn add_batch_is_add_in_order(
        sha in any::<bool>(),
        unit in prop_oneof![Just(1u32), Just(4), Just(16)],
        live in any::<bool>(),
        before in proptest::collection::vec((request(), any::<bool>()), 0..6),
        reqs in proptest::collection::vec(request(), 0..12),
        threads in 0usize..4,
    ) {
        let algorithm = if sha { HashAlgorithm::Sha256 } else { HashAlgorithm::Xxh3_128 };
        check(&config(algorithm, unit, live), &before, &reqs, threads)?;
    }
}

/// Requests that reuse one another inside the batch (each extends the previous, and live
/// prefixes), long enough that two threads hash them: the same as `add` one by one.
#[test]
fn chains_within_one_batch() {
    let head: Vec<u32> = (0..4096).collect();
    let reqs: Vec<Req> = (0..12u64)
        .map(|i| {
            let mut tokens = head.clone();
            tokens.extend((0..3000 + 7 * i as u32).map(|t| t ^ (i as u32) << 20));
            let extends = (i % 3 != 0).then(|| i - 1);
            Req { id: i, tokens, extra: ExtraKeys::default(), extends }
        })
        .collect();
    for live in [false, true] {
        for threads in [1, 2, 8] {
            let c = config(HashAlgorithm::Sha256, 16, live);
            check(&c, &[], &reqs, threads).expect("add_batch as add");
        }
    }
}

#[test]
fn refusals() {
    let mut m = CacheManager::new(config(HashAlgorithm::Sha256, 4, true)).expect("config");
    let t: Vec<u32> = (0..64).collect();
    m.add(1, &t, ExtraKeys::default(), None).expect("add");
    let one = |id| AddRequest { seq_id: id, tokens: &t, ..AddRequest::default() };
    // A live id, an id twice, an empty prompt: nothing admitted, the error `add` gives.
    assert_eq!(
        m.add_batch(vec![one(2), one(1)], 0),
        Err(CacheError::DuplicateSequence { seq_id: 1 })
    );
    assert_eq!(
        m.add_batch(vec![one(2), one(3), one(2)], 0),
        Err(CacheError::DuplicateSequence { seq_id: 2 })
    );
    let empty = AddRequest { seq_id: 4, tokens: &[], ..AddRequest::default() };
    assert!(matches!(m.add_batch(vec![one(3), empty], 0), Err(CacheError::InvalidRequest { .. })));
    assert_eq!(m.num_sequences(), 1);
    assert!(matches!(m.add_batch(vec![one(2)], 65), Err(CacheError::InvalidRequest { .. })));
    assert_eq!(m.add_batch(Vec::new(), 0), Ok(Vec::new()));
    assert_eq!(m.num_sequences(), 1);
}
