//! Prompt hashing cost per unit (criterion).
//!
//! Guards the hashing targets: at most 20 ns per 16-token unit and 60 ns per 128-token unit with
//! `xxh3_128` on one core (sha256 is measured for the multi-tenant configuration, without a
//! target). Each iteration hashes a fresh 8,192-unit prompt through `Hasher::extend`, the path
//! `add` and `append` take, so the figure includes the encoding, the chaining and the digest
//! vector; throughput is reported per unit (`elem/s`), its inverse is the cost per unit.
//!
//! `sha256_floor` measures what SHA-256 itself allows on this CPU, below any encoding work: a
//! 16-token unit is 105 bytes (version, 32-byte parent, count, tokens, extra-key count), two
//! 64-byte blocks, and `sha2::compress256` alone is timed on such units, one chained through
//! the next unit's message as the encoding chains them, and independent ones (nothing to wait
//! for: the compression's own throughput).
//!
//! Run: `cargo bench -p prefixcache-core --bench hashing`
//! (quick: `cargo bench -p prefixcache-core --bench hashing -- --warm-up-time 1 --measurement-time 3`).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use prefixcache_core::hashing::{Digest, ExtraKeys, HashAlgorithm, Hasher, DEFAULT_SEED};
use sha2::compress256;
use sha2::digest::consts::U64;
use sha2::digest::generic_array::GenericArray;

/// Units hashed per iteration.
const UNITS: usize = 8192;

/// Token ids spread over a realistic vocabulary (so no byte pattern is constant).
fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|t| t.wrapping_mul(2_654_435_761) % 200_000).collect()
}

fn hash_prompt(criterion: &mut Criterion) {
    let extra = ExtraKeys::default();
    let mut group = criterion.benchmark_group("hash_prompt");
    group.throughput(Throughput::Elements(UNITS as u64));
    for algorithm in [HashAlgorithm::Xxh3_128, HashAlgorithm::Sha256] {
        for unit in [16u32, 128] {
            let tokens = prompt(UNITS * unit as usize);
            let mut hasher = Hasher::new(algorithm, DEFAULT_SEED);
            let mut digests: Vec<Digest> = Vec::with_capacity(UNITS);
            let id = BenchmarkId::new(algorithm.name(), format!("unit_{unit}"));
            group.bench_with_input(id, &tokens, |bencher, tokens| {
                bencher.iter(|| {
                    digests.clear();
                    hasher.extend(black_box(tokens), unit, &extra, &mut digests);
                    black_box(digests.last().copied())
                });
            });
        }
    }
    group.finish();
}

fn hash_prompt_with_extra_keys(criterion: &mut Criterion) {
    // A LoRA id on every unit and one image: the slower encoding path, for comparison.
    let extra = ExtraKeys {
        cache_salt: Some(b"tenant-a".to_vec()),
        lora_id: Some(7),
        multimodal: vec![prefixcache_core::hashing::MultimodalInput {
            start: 100,
            end: 700,
            hash: vec![0xab; 32],
        }],
    };
    let mut group = criterion.benchmark_group("hash_prompt_with_extra_keys");
    group.throughput(Throughput::Elements(UNITS as u64));
    let unit = 16u32;
    let tokens = prompt(UNITS * unit as usize);
    let mut hasher = Hasher::new(HashAlgorithm::Xxh3_128, DEFAULT_SEED);
    let mut digests: Vec<Digest> = Vec::with_capacity(UNITS);
    group.bench_function(BenchmarkId::new("xxh3_128", format!("unit_{unit}")), |bencher| {
        bencher.iter(|| {
            digests.clear();
            hasher.extend(black_box(&tokens), unit, &extra, &mut digests);
            black_box(digests.last().copied())
        });
    });
    group.finish();
}

/// The chaining value each unit starts from (SHA-256 starts from its IV; the values do not
/// change the cost).
const START: [u32; 8] = [0x0123_4567; 8];

fn sha256_floor(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("sha256_floor");
    group.throughput(Throughput::Elements(UNITS as u64));
    // Two blocks holding a 105-byte unit and its padding; the contents do not change the cost.
    let mut blocks = [GenericArray::<u8, U64>::default(); 2];
    for (i, byte) in blocks.iter_mut().flatten().enumerate() {
        *byte = i as u8;
    }
    group.bench_function("unit_16_chained", |bencher| {
        bencher.iter(|| {
            let mut state = START;
            for _ in 0..UNITS {
                // The digest is the next unit's parent, bytes 1..33 of its first block.
                for (bytes, word) in blocks[0][1..33].chunks_exact_mut(4).zip(state) {
                    bytes.copy_from_slice(&word.to_be_bytes());
                }
                state = START;
                compress256(&mut state, &blocks);
            }
            black_box(state)
        });
    });
    group.bench_function("unit_16_independent", |bencher| {
        bencher.iter(|| {
            let mut last = 0;
            for _ in 0..UNITS {
                let mut state = START;
                compress256(&mut state, black_box(&blocks));
                last ^= state[0];
            }
            black_box(last)
        });
    });
    group.finish();
}

criterion_group!(benches, hash_prompt, hash_prompt_with_extra_keys, sha256_floor);
criterion_main!(benches);
