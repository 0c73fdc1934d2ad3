//! Chained prefix hashing: the digests `h[i]` that name every cached unit of a sequence.
//!
//! This module owns the byte encoding (format version [`ENCODING_VERSION`]) from which every
//! cache key is derived, and the [`Hasher`] that computes it without allocating per unit. It does
//! not own keys, lookups or token verification (`HashConfig::verify_tokens` is carried here for
//! the manager, which stores and compares the tokens).
//!
//! # Encoding, version 1
//!
//! `HASH` is either `xxh3_128` (the 128-bit XXH3 hash with seed 0, its `u128` result stored
//! little-endian: a 16-byte digest) or SHA-256 (a 32-byte digest). All integers are little-endian.
//!
//! ```text
//! h[-1] = HASH(b"prefixcache" ++ seed as u64)
//! h[i]  = HASH(
//!     u8   ENCODING_VERSION (1)
//!     h[i-1]               16 bytes (xxh3_128) or 32 bytes (sha256)
//!     u32  token count     (U for a full unit)
//!     u32  token, for each token of [i*U, (i+1)*U)
//!     u32  number of extra-key entries
//!     for each entry:  u8 tag, u32 byte length, the bytes
//! )
//! ```
//!
//! Extra-key entries, in this order:
//! - tag 1: the cache salt, on unit 0 only (later units depend on it through the chain). A salt
//!   of zero bytes is an entry of length 0, distinct from no salt.
//! - tag 2: the adapter id `lora_id` as a `u64` (8 bytes), on every unit, when set.
//! - tag 3: a multimodal hash, once for each multimodal input whose token range `[start, end)`
//!   overlaps the unit's range `[i*U, (i+1)*U)`, in the order the inputs are given.
//!
//! The seed enters only through `h[-1]` (XXH3's own seed is always 0), so the whole chain depends
//! on it. docs/HASHING.md carries test vectors and an independent Python
//! implementation.
//!
//! # Invariants
//! - `h[i]` depends on every token of `[0, (i+1)U)`, the seed, the salt, `lora_id` and the
//!   multimodal inputs overlapping `[0, (i+1)U)`, and on nothing else: appending tokens never
//!   changes an existing digest, which is what makes incremental hashing ([`Hasher::extend`]) and
//!   prefix reuse between sequences correct.
//! - Only full units are hashed; a partial tail unit has no digest.
//! - Hashing never fails and never panics: extra keys are encoded as given (an empty or inverted
//!   multimodal range overlaps no unit); [`ExtraKeys::validate`] is the caller's check.
//! - [`Hasher::extend`] allocates nothing per unit once its two scratch buffers have grown to the
//!   unit's size: it encodes unit `i+1` while unit `i` is being hashed, then only writes the parent.
//! - A [`Digest`] is 32 bytes whatever the algorithm; for `xxh3_128` the last 16 are zero. Digests
//!   of different algorithms must never be compared (the caller keeps one algorithm per cache).

use sha2::digest::consts::U64;
use sha2::digest::generic_array::GenericArray;
use sha2::{compress256, Digest as _, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use crate::error::CacheError;
use crate::limits::{
    try_vec, MAX_EXTRA_KEY_BYTES, MAX_HASH_UNIT, MAX_MULTIMODAL_INPUTS, MAX_SEQUENCE_TOKENS,
};

/// Version of the byte encoding; the first byte of every unit's hash input.
pub const ENCODING_VERSION: u8 = 1;

/// Seed used when the configuration does not name one.
pub const DEFAULT_SEED: u64 = 0;

/// Domain-separation prefix of the seed digest `h[-1]`.
const SEED_DOMAIN: &[u8] = b"prefixcache";

/// Extra-key entry tag of the cache salt (unit 0 only).
const TAG_CACHE_SALT: u8 = 1;
/// Extra-key entry tag of the adapter id `lora_id` (every unit).
const TAG_LORA_ID: u8 = 2;
/// Extra-key entry tag of a multimodal input's hash (units its range overlaps).
const TAG_MULTIMODAL: u8 = 3;

/// Largest digest, in bytes (SHA-256).
const MAX_DIGEST_LEN: usize = 32;

/// A unit digest: 16 meaningful bytes for `xxh3_128` (the rest zero), 32 for `sha256`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The meaningful bytes of the digest: 16 for `xxh3_128`, 32 for `sha256`.
    #[must_use]
    pub fn as_bytes(&self, algorithm: HashAlgorithm) -> &[u8] {
        &self.0[..algorithm.digest_len()]
    }

    /// Lowercase hexadecimal of [`Digest::as_bytes`] (32 or 64 characters).
    #[must_use]
    pub fn to_hex(&self, algorithm: HashAlgorithm) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let bytes = self.as_bytes(algorithm);
        let mut hex = String::with_capacity(bytes.len() * 2);
        for &byte in bytes {
            hex.push(char::from(HEX[usize::from(byte >> 4)]));
            hex.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
        hex
    }
}

/// The hash function behind every digest.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum HashAlgorithm {
    /// XXH3 128-bit: fast, not collision resistant against an adversary.
    #[default]
    Xxh3_128,
    /// SHA-256: for multi-tenant deployments where collisions must be infeasible.
    Sha256,
}

impl HashAlgorithm {
    /// Digest length in bytes: 16 for `xxh3_128`, 32 for `sha256`.
    #[must_use]
    pub fn digest_len(self) -> usize {
        match self {
            Self::Xxh3_128 => 16,
            Self::Sha256 => 32,
        }
    }

    /// The configuration name: `"xxh3_128"` or `"sha256"`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Xxh3_128 => "xxh3_128",
            Self::Sha256 => "sha256",
        }
    }

    /// Parses a configuration name (exactly `"xxh3_128"` or `"sha256"`).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "xxh3_128" => Some(Self::Xxh3_128),
            "sha256" => Some(Self::Sha256),
            _ => None,
        }
    }

    /// `HASH(input)` as a [`Digest`].
    fn digest(self, input: &[u8]) -> Digest {
        match self {
            Self::Xxh3_128 => xxh3_digest(input),
            Self::Sha256 => sha256_digest(input),
        }
    }
}

/// How a cache hashes its sequences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HashConfig {
    /// Hash function of every digest.
    pub algorithm: HashAlgorithm,
    /// Enters the chain through `h[-1]`; processes that share a cache must share it.
    pub seed: u64,
    /// Hash unit U in tokens (>= 1): every prefix hit is a multiple of it.
    pub unit: u32,
    /// Whether a hit also compares the stored tokens (collision-proof at a memory cost).
    pub verify_tokens: bool,
}

impl Default for HashConfig {
    fn default() -> Self {
        Self {
            algorithm: HashAlgorithm::Xxh3_128,
            seed: DEFAULT_SEED,
            unit: 16,
            verify_tokens: false,
        }
    }
}

/// A multimodal input (an image, an audio clip) occupying a token range of the sequence.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct MultimodalInput {
    /// First token of the range.
    pub start: u32,
    /// One past the last token of the range (exclusive).
    pub end: u32,
    /// Content hash of the input, computed by the engine; non-empty.
    pub hash: Vec<u8>,
}

/// Everything besides the tokens that distinguishes two sequences' caches.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ExtraKeys {
    /// Isolates tenants: sequences with different salts never share a digest.
    pub cache_salt: Option<Vec<u8>>,
    /// Id of the adapter (`LoRA`) the sequence runs with.
    pub lora_id: Option<u64>,
    /// Multimodal inputs with their token ranges.
    pub multimodal: Vec<MultimodalInput>,
}

impl ExtraKeys {
    /// True when there is no salt, no `lora_id` and no multimodal input.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.cache_salt.is_none() && self.lora_id.is_none() && self.multimodal.is_empty()
    }

    /// Checks the extra keys of a sequence of `tokens_len` tokens: every multimodal range is
    /// non-empty and within the tokens, every hash is non-empty, the inputs are in order of their
    /// start (ties by end), and no byte string is longer than the encoding's `u32` length field.
    /// One rule for the manager and for [`hash_prefix`], so a router never computes keys the
    /// cache refuses.
    ///
    /// The order matters beyond tidiness: reusing digests between two sequences (`extends`, live
    /// prefixes) stops at the earliest start among the inputs that differ, which for sorted lists
    /// is the start of the first differing list entry.
    pub fn validate(&self, tokens_len: usize) -> Result<(), String> {
        if let Some(salt) = &self.cache_salt {
            if salt.len() > MAX_EXTRA_KEY_BYTES {
                return Err(format!(
                    "cache_salt is {} bytes, more than the limit of {MAX_EXTRA_KEY_BYTES} bytes; \
                     pass a digest of it instead",
                    salt.len()
                ));
            }
        }
        if self.multimodal.len() > MAX_MULTIMODAL_INPUTS {
            return Err(format!(
                "{} multimodal inputs, more than the limit of {MAX_MULTIMODAL_INPUTS} a sequence",
                self.multimodal.len()
            ));
        }
        let mut previous: Option<&MultimodalInput> = None;
        for (index, input) in self.multimodal.iter().enumerate() {
            if input.start >= input.end {
                return Err(format!(
                    "multimodal input {index} has token range [{}, {}), which is empty; \
                     set start < end (end is exclusive)",
                    input.start, input.end
                ));
            }
            if input.end as usize > tokens_len {
                return Err(format!(
                    "multimodal input {index} has token range [{}, {}), which ends beyond the \
                     {tokens_len} tokens of the sequence",
                    input.start, input.end
                ));
            }
            if input.hash.is_empty() {
                return Err(format!(
                    "multimodal input {index} has an empty hash; pass the content hash of the input"
                ));
            }
            if input.hash.len() > MAX_EXTRA_KEY_BYTES {
                return Err(format!(
                    "multimodal input {index} has a {}-byte hash, more than the limit of \
                     {MAX_EXTRA_KEY_BYTES} bytes; pass a digest of it instead",
                    input.hash.len()
                ));
            }
            if let Some(prev) = previous {
                if (input.start, input.end) < (prev.start, prev.end) {
                    return Err(format!(
                        "multimodal input {index} at [{}, {}) is listed after input {} at \
                         [{}, {}): multimodal inputs must be given in order of their start \
                         (ties by end); sort them by (start, end)",
                        input.start,
                        input.end,
                        index - 1,
                        prev.start,
                        prev.end
                    ));
                }
            }
            previous = Some(input);
        }
        Ok(())
    }
}

/// Reusable hashing context: owns the scratch buffers so hashing allocates nothing per unit.
#[derive(Clone, Debug)]
pub struct Hasher {
    algorithm: HashAlgorithm,
    seed_digest: Digest,
    /// Hash input of the unit being hashed; overwritten per unit, its capacity kept.
    buffer: Vec<u8>,
    /// Hash input of the following unit, encoded ahead by `extend` (all but the parent).
    next: Vec<u8>,
    /// SHA-256 only: `buffer` padded into whole message blocks; overwritten per unit.
    sha_blocks: Vec<ShaBlock>,
}

impl Hasher {
    /// A hasher for `algorithm` whose chains start at the digest of `seed`.
    #[must_use]
    pub fn new(algorithm: HashAlgorithm, seed: u64) -> Self {
        let mut seed_input = [0u8; SEED_DOMAIN.len() + 8];
        seed_input[..SEED_DOMAIN.len()].copy_from_slice(SEED_DOMAIN);
        seed_input[SEED_DOMAIN.len()..].copy_from_slice(&seed.to_le_bytes());
        Self {
            algorithm,
            seed_digest: algorithm.digest(&seed_input),
            buffer: Vec::new(),
            next: Vec::new(),
            sha_blocks: Vec::new(),
        }
    }

    /// The hash function of every digest this hasher produces.
    #[must_use]
    pub fn algorithm(&self) -> HashAlgorithm {
        self.algorithm
    }

    /// `h[-1]`, the parent of unit 0.
    #[must_use]
    pub fn seed_digest(&self) -> Digest {
        self.seed_digest
    }

    /// Digest of unit `unit_index` (tokens = exactly that unit's tokens) given its parent digest.
    ///
    /// The unit's token range, against which multimodal inputs are matched, is
    /// `[unit_index * tokens.len(), (unit_index + 1) * tokens.len())`.
    pub fn hash_unit(
        &mut self,
        parent: &Digest,
        unit_index: usize,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> Digest {
        encode_unit(&mut self.buffer, self.algorithm, unit_index, tokens, extra);
        self.finish_unit(parent)
    }

    /// Appends to `hashes` the digests of every full unit of `tokens` (unit size `unit`) not yet
    /// in `hashes` (`hashes.len()` units are assumed already hashed: incremental hashing on append).
    ///
    /// Appends nothing when `unit` is 0 or when `hashes` already covers every full unit.
    pub fn extend(
        &mut self,
        tokens: &[u32],
        unit: u32,
        extra: &ExtraKeys,
        hashes: &mut Vec<Digest>,
    ) {
        let unit = unit as usize;
        if unit == 0 {
            return;
        }
        let full_units = tokens.len() / unit;
        let first = hashes.len();
        if first >= full_units {
            return;
        }
        hashes.reserve(full_units - first);
        let mut parent = hashes.last().copied().unwrap_or(self.seed_digest);
        let mut units = tokens.chunks_exact(unit).enumerate().skip(first);
        let mut current = units.next();
        if let Some((unit_index, unit_tokens)) = current {
            encode_unit(&mut self.buffer, self.algorithm, unit_index, unit_tokens, extra);
        }
        while current.is_some() {
            // The next unit is encoded before this one is hashed: its tokens do not depend on
            // this digest, and by the time the hash reads them the CPU has long finished writing
            // them (a read of bytes still in flight in the store buffer stalls the chain).
            let next = units.next();
            if let Some((unit_index, unit_tokens)) = next {
                encode_unit(&mut self.next, self.algorithm, unit_index, unit_tokens, extra);
            }
            parent = self.finish_unit(&parent);
            hashes.push(parent);
            std::mem::swap(&mut self.buffer, &mut self.next);
            current = next;
        }
    }

    /// [`Hasher::extend`] of two independent SHA-256 chains at once, a unit of each in turn,
    /// `a` on this hasher and `b` on `other` (same algorithm and seed), each `(tokens, extra,
    /// digests)`; it returns as soon as one of them has every full unit hashed (the other is
    /// left part-way, to be extended further). Other algorithms: `extend` of each.
    ///
    /// Speed only: one unit's compression is a chain of dependent rounds (with SHA-NI, each
    /// round waits for the one before), so the two units are padded first and then compressed
    /// back to back, and the CPU runs the second chain's rounds in the cycles the first one
    /// waits. Each hasher encodes its next unit ahead, as `extend` does. The digests are those
    /// of `extend`.
    pub(crate) fn extend_pair(
        &mut self,
        other: &mut Hasher,
        unit: u32,
        a: (&[u32], &ExtraKeys, &mut Vec<Digest>),
        b: (&[u32], &ExtraKeys, &mut Vec<Digest>),
    ) {
        let (ta, ea, ha) = a;
        let (tb, eb, hb) = b;
        if self.algorithm != HashAlgorithm::Sha256 || other.algorithm != self.algorithm {
            self.extend(ta, unit, ea, ha);
            other.extend(tb, unit, eb, hb);
            return;
        }
        let unit = unit as usize;
        let (na, nb) = (ta.len() / unit, tb.len() / unit);
        let (mut i, mut j) = (ha.len(), hb.len());
        if unit == 0 || i >= na || j >= nb {
            return;
        }
        let algorithm = self.algorithm;
        let mut pa = ha.last().copied().unwrap_or(self.seed_digest);
        let mut pb = hb.last().copied().unwrap_or(other.seed_digest);
        encode_unit(&mut self.buffer, algorithm, i, &ta[i * unit..(i + 1) * unit], ea);
        encode_unit(&mut other.buffer, algorithm, j, &tb[j * unit..(j + 1) * unit], eb);
        loop {
            let more = i + 1 < na && j + 1 < nb;
            if more {
                let (ua, ub) =
                    (&ta[(i + 1) * unit..(i + 2) * unit], &tb[(j + 1) * unit..(j + 2) * unit]);
                encode_unit(&mut self.next, algorithm, i + 1, ua, ea);
                encode_unit(&mut other.next, algorithm, j + 1, ub, eb);
            }
            for (h, parent) in [(&mut *self, &pa), (&mut *other, &pb)] {
                h.buffer[0] = ENCODING_VERSION;
                h.buffer[1..33].copy_from_slice(&parent.0);
                sha256_pad(&h.buffer, &mut h.sha_blocks);
            }
            pa = sha256_compress(&self.sha_blocks);
            pb = sha256_compress(&other.sha_blocks);
            ha.push(pa);
            hb.push(pb);
            if !more {
                return;
            }
            std::mem::swap(&mut self.buffer, &mut self.next);
            std::mem::swap(&mut other.buffer, &mut other.next);
            (i, j) = (i + 1, j + 1);
        }
    }

    /// Writes the version and `parent` into the encoded unit in `self.buffer` and hashes it.
    fn finish_unit(&mut self, parent: &Digest) -> Digest {
        let buffer = &mut self.buffer;
        match self.algorithm {
            HashAlgorithm::Xxh3_128 => {
                // Bytes 0..24 (version, parent, count, first token bytes) as three 8-byte
                // writes, which line up with XXH3's 8-byte reads of them: the reads are then
                // served from the writes directly instead of waiting for them to reach the
                // cache. Speed only (-35% per 16-token unit); the bytes are those of the spec.
                let parent = u128::from_le_bytes(xxh3_parent(parent));
                let mut after_parent = [0u8; 8];
                after_parent[1..].copy_from_slice(&buffer[17..24]);
                let words = [
                    u64::from(ENCODING_VERSION) | ((parent as u64) << 8),
                    (parent >> 56) as u64,
                    ((parent >> 120) as u64) | u64::from_le_bytes(after_parent),
                ];
                for (bytes, word) in buffer[..24].chunks_exact_mut(8).zip(words) {
                    bytes.copy_from_slice(&word.to_le_bytes());
                }
                xxh3_digest(buffer)
            }
            HashAlgorithm::Sha256 => {
                buffer[0] = ENCODING_VERSION;
                buffer[1..33].copy_from_slice(&parent.0);
                sha256_blocks(buffer, &mut self.sha_blocks)
            }
        }
    }
}

/// `xxh3_128(input)` (seed 0), its `u128` stored little-endian in the first 16 bytes.
fn xxh3_digest(input: &[u8]) -> Digest {
    let mut out = [0u8; MAX_DIGEST_LEN];
    out[..16].copy_from_slice(&xxh3_128(input).to_le_bytes());
    Digest(out)
}

/// `SHA-256(input)`.
fn sha256_digest(input: &[u8]) -> Digest {
    Digest(Sha256::digest(input).into())
}

/// SHA-256's initial hash value (FIPS 180-4, section 5.3.3).
const SHA256_IV: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// One 64-byte SHA-256 message block.
type ShaBlock = GenericArray<u8, U64>;

/// `SHA-256(input)`, the same digest as [`sha256_digest`]: `input` is copied into `blocks` with
/// its padding (FIPS 180-4, section 5.1.1: a one bit, zeros, the message length in bits as a
/// big-endian `u64`) and all of them go to the library's compression function in one call.
///
/// Speed only: `Sha256::digest` copies the input through its block buffer and pads a copy of
/// the last block, which a 105-byte unit pays on every unit.
fn sha256_blocks(input: &[u8], blocks: &mut Vec<ShaBlock>) -> Digest {
    sha256_pad(input, blocks);
    sha256_compress(blocks)
}

/// `input` copied into `blocks` with SHA-256's padding (the first half of [`sha256_blocks`]).
fn sha256_pad(input: &[u8], blocks: &mut Vec<ShaBlock>) {
    let len = input.len();
    let count = (len + 9).div_ceil(64);
    blocks.resize(count, ShaBlock::default());
    let mut chunks = input.chunks(64);
    for block in blocks.iter_mut() {
        let chunk = chunks.next().unwrap_or(&[]);
        block[..chunk.len()].copy_from_slice(chunk);
        block[chunk.len()..].fill(0);
    }
    blocks[len / 64][len % 64] = 0x80;
    blocks[count - 1][56..].copy_from_slice(&((len as u64) * 8).to_be_bytes());
}

/// The digest of padded `blocks` (the second half of [`sha256_blocks`]).
fn sha256_compress(blocks: &[ShaBlock]) -> Digest {
    let mut state = SHA256_IV;
    compress256(&mut state, blocks);
    let mut out = [0u8; MAX_DIGEST_LEN];
    for (bytes, word) in out.chunks_exact_mut(4).zip(state) {
        bytes.copy_from_slice(&word.to_be_bytes());
    }
    Digest(out)
}

/// The 16 meaningful bytes of an `xxh3_128` digest, as an array (a constant-length copy).
fn xxh3_parent(digest: &Digest) -> [u8; 16] {
    let mut parent = [0u8; 16];
    parent.copy_from_slice(&digest.0[..16]);
    parent
}

/// Writes the hash input of one unit into `buffer`, all but the version byte and the parent
/// digest (left for [`Hasher::finish_unit`]).
///
/// Everything up to the last token is written in place over a buffer of exactly that length: in
/// steady state (same unit size) `resize` only moves the length back and every byte is
/// overwritten, so nothing is allocated, zeroed or capacity-checked per token. The buffer is at
/// least 25 bytes long (version, 16-byte parent, two counts) when this returns.
fn encode_unit(
    buffer: &mut Vec<u8>,
    algorithm: HashAlgorithm,
    unit_index: usize,
    tokens: &[u32],
    extra: &ExtraKeys,
) {
    let count_at = 1 + algorithm.digest_len();
    let tokens_at = count_at + 4;
    let tokens_end = tokens_at + 4 * tokens.len();
    buffer.resize(tokens_end, 0);
    buffer[count_at..tokens_at].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
    for (bytes, token) in buffer[tokens_at..tokens_end].chunks_exact_mut(4).zip(tokens) {
        bytes.copy_from_slice(&token.to_le_bytes());
    }
    if extra.is_empty() {
        buffer.extend_from_slice(&0u32.to_le_bytes());
    } else {
        encode_extra_keys(buffer, unit_index, tokens.len(), extra);
    }
}

/// Writes the entry count and the extra-key entries of unit `unit_index` (of `unit_len` tokens).
fn encode_extra_keys(buffer: &mut Vec<u8>, unit_index: usize, unit_len: usize, extra: &ExtraKeys) {
    let count_at = buffer.len();
    buffer.extend_from_slice(&0u32.to_le_bytes());
    let mut count: u32 = 0;
    if unit_index == 0 {
        if let Some(salt) = &extra.cache_salt {
            push_entry(buffer, TAG_CACHE_SALT, salt);
            count += 1;
        }
    }
    if let Some(lora_id) = extra.lora_id {
        push_entry(buffer, TAG_LORA_ID, &lora_id.to_le_bytes());
        count += 1;
    }
    // u64 arithmetic: a unit range beyond u32 tokens overlaps nothing instead of wrapping.
    let unit_start = (unit_index as u64).saturating_mul(unit_len as u64);
    let unit_end = unit_start.saturating_add(unit_len as u64);
    for input in &extra.multimodal {
        if u64::from(input.start) < unit_end && u64::from(input.end) > unit_start {
            push_entry(buffer, TAG_MULTIMODAL, &input.hash);
            count = count.wrapping_add(1);
        }
    }
    buffer[count_at..count_at + 4].copy_from_slice(&count.to_le_bytes());
}

/// The encoded extra-key entries of unit `unit_index` (of `unit_len` tokens) into `out`, as
/// they enter the unit's hash input after the entry count; empty when the unit has none. What
/// `verify_tokens` stores and compares besides the parent digest and the tokens.
pub(crate) fn unit_extra_entries(
    out: &mut Vec<u8>,
    unit_index: usize,
    unit_len: usize,
    extra: &ExtraKeys,
) {
    out.clear();
    if extra.is_empty() {
        return;
    }
    encode_extra_keys(out, unit_index, unit_len, extra);
    if out[..4] == [0; 4] {
        out.clear();
    }
}

/// Writes one extra-key entry: tag, `u32` byte length, bytes.
fn push_entry(buffer: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
    buffer.push(tag);
    buffer.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buffer.extend_from_slice(bytes);
}

/// Digests of every full unit of `tokens` (for external routers and the Python `hash_prefix`),
/// after the checks a [`crate::CacheManager`] makes of the same input: a prompt the cache would
/// refuse gets no keys.
///
/// # Errors
/// [`CacheError::InvalidRequest`] for a unit outside `1..=MAX_HASH_UNIT`, more than
/// `MAX_SEQUENCE_TOKENS` tokens, extra keys that [`ExtraKeys::validate`] refuses, or digests that
/// cannot be allocated.
pub fn hash_prefix(
    config: &HashConfig,
    tokens: &[u32],
    extra: &ExtraKeys,
) -> Result<Vec<Digest>, CacheError> {
    if config.unit == 0 || config.unit > MAX_HASH_UNIT {
        return Err(CacheError::invalid(format!(
            "hash unit {} is outside 1..={MAX_HASH_UNIT}",
            config.unit
        )));
    }
    validate_sequence(tokens.len(), extra)?;
    let mut hashes = try_vec(tokens.len() / config.unit as usize, "the digests of the prompt")
        .map_err(CacheError::invalid)?;
    Hasher::new(config.algorithm, config.seed).extend(tokens, config.unit, extra, &mut hashes);
    Ok(hashes)
}

/// The checks every sequence passes before it is hashed: at most `MAX_SEQUENCE_TOKENS` tokens,
/// and extra keys that [`ExtraKeys::validate`] accepts.
pub(crate) fn validate_sequence(tokens_len: usize, extra: &ExtraKeys) -> Result<(), CacheError> {
    if tokens_len > MAX_SEQUENCE_TOKENS {
        return Err(CacheError::invalid(format!(
            "sequence of {tokens_len} tokens is longer than the supported {MAX_SEQUENCE_TOKENS}"
        )));
    }
    extra.validate(tokens_len).map_err(CacheError::invalid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UNIT: u32 = 16;

    fn tokens(len: u32) -> Vec<u32> {
        (0..len).map(|t| t.wrapping_mul(2_654_435_761) % 200_000).collect()
    }

    fn hashes(
        algorithm: HashAlgorithm,
        seed: u64,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> Vec<Digest> {
        let config = HashConfig { algorithm, seed, unit: UNIT, verify_tokens: false };
        hash_prefix(&config, tokens, extra).unwrap()
    }

    fn xxh3(tokens: &[u32], extra: &ExtraKeys) -> Vec<Digest> {
        hashes(HashAlgorithm::Xxh3_128, DEFAULT_SEED, tokens, extra)
    }

    /// Indices at which two digest lists differ.
    fn differing(a: &[Digest], b: &[Digest]) -> Vec<usize> {
        assert_eq!(a.len(), b.len());
        (0..a.len()).filter(|&i| a[i] != b[i]).collect()
    }

    /// Recomputes unit `index` of `chain` from its recorded parent, so a unit's *direct*
    /// dependence on the extra keys can be told apart from the dependence through the chain.
    fn rehash_with_parent_of(
        chain: &[Digest],
        index: usize,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> Digest {
        let mut hasher = Hasher::new(HashAlgorithm::Xxh3_128, DEFAULT_SEED);
        let parent = if index == 0 { hasher.seed_digest() } else { chain[index - 1] };
        let range = index * UNIT as usize..(index + 1) * UNIT as usize;
        hasher.hash_unit(&parent, index, &tokens[range], extra)
    }

    #[test]
    fn hashes_only_full_units() {
        let none = ExtraKeys::default();
        assert_eq!(xxh3(&tokens(15), &none).len(), 0);
        assert_eq!(xxh3(&tokens(16), &none).len(), 1);
        assert_eq!(xxh3(&tokens(47), &none).len(), 2);
        assert_eq!(xxh3(&tokens(48), &none).len(), 3);
    }

    #[test]
    fn changing_a_token_changes_its_unit_and_every_later_one_only() {
        let none = ExtraKeys::default();
        let base = tokens(8 * UNIT);
        let before = xxh3(&base, &none);
        for position in [0, 17, 63, 64, 127] {
            let mut changed = base.clone();
            changed[position] ^= 1;
            let unit = position / UNIT as usize;
            let expected: Vec<usize> = (unit..8).collect();
            assert_eq!(differing(&before, &xxh3(&changed, &none)), expected, "token {position}");
        }
    }

    #[test]
    fn appending_tokens_keeps_existing_digests() {
        let none = ExtraKeys::default();
        let long = tokens(10 * UNIT + 3);
        let short = &long[..5 * UNIT as usize + 7];
        let full = xxh3(&long, &none);
        assert_eq!(xxh3(short, &none), full[..5]);
    }

    #[test]
    fn incremental_extend_equals_one_shot() {
        let extra = ExtraKeys {
            cache_salt: Some(b"salt".to_vec()),
            lora_id: Some(3),
            multimodal: vec![MultimodalInput { start: 20, end: 70, hash: b"img".to_vec() }],
        };
        let all = tokens(9 * UNIT + 5);
        for algorithm in [HashAlgorithm::Xxh3_128, HashAlgorithm::Sha256] {
            let one_shot = hashes(algorithm, 9, &all, &extra);
            let mut hasher = Hasher::new(algorithm, 9);
            let mut incremental = Vec::new();
            for end in [0, 3, 16, 17, 40, 80, 81, all.len()] {
                hasher.extend(&all[..end], UNIT, &extra, &mut incremental);
                assert_eq!(incremental.len(), end / UNIT as usize);
            }
            assert_eq!(incremental, one_shot);
        }
    }

    #[test]
    fn extend_with_every_unit_already_hashed_appends_nothing() {
        let none = ExtraKeys::default();
        let all = tokens(4 * UNIT);
        let mut hasher = Hasher::new(HashAlgorithm::Xxh3_128, 0);
        let mut digests = xxh3(&all, &none);
        hasher.extend(&all[..2 * UNIT as usize], UNIT, &none, &mut digests);
        assert_eq!(digests, xxh3(&all, &none));
        hasher.extend(&all, 0, &none, &mut digests);
        assert_eq!(digests.len(), 4);
    }

    #[test]
    fn cache_salt_enters_unit_zero_directly_and_later_units_through_the_chain() {
        let all = tokens(4 * UNIT);
        let none = ExtraKeys::default();
        let salted = ExtraKeys { cache_salt: Some(b"tenant-a".to_vec()), ..ExtraKeys::default() };
        let plain = xxh3(&all, &none);
        let with_salt = xxh3(&all, &salted);
        assert_eq!(differing(&plain, &with_salt), vec![0, 1, 2, 3]);
        // Given the same parent, units after the first ignore the salt.
        for index in 1..4 {
            assert_eq!(rehash_with_parent_of(&with_salt, index, &all, &none), with_salt[index]);
        }
        assert_ne!(rehash_with_parent_of(&with_salt, 0, &all, &none), with_salt[0]);
        // An empty salt is a salt, not the absence of one.
        let empty_salt = ExtraKeys { cache_salt: Some(Vec::new()), ..ExtraKeys::default() };
        assert_ne!(xxh3(&all, &empty_salt)[0], plain[0]);
    }

    #[test]
    fn lora_id_enters_every_unit_directly() {
        let all = tokens(3 * UNIT);
        let none = ExtraKeys::default();
        let lora = ExtraKeys { lora_id: Some(7), ..ExtraKeys::default() };
        let with_lora = xxh3(&all, &lora);
        for index in 0..3 {
            assert_ne!(rehash_with_parent_of(&with_lora, index, &all, &none), with_lora[index]);
        }
        let other = ExtraKeys { lora_id: Some(8), ..ExtraKeys::default() };
        assert_eq!(differing(&with_lora, &xxh3(&all, &other)), vec![0, 1, 2]);
    }

    #[test]
    fn multimodal_input_enters_only_the_units_it_overlaps_directly() {
        let all = tokens(6 * UNIT);
        let none = ExtraKeys::default();
        // [20, 50) overlaps units 1 ([16, 32)), 2 ([32, 48)) and 3 ([48, 64)).
        let image = ExtraKeys {
            multimodal: vec![MultimodalInput { start: 20, end: 50, hash: b"img0".to_vec() }],
            ..ExtraKeys::default()
        };
        let plain = xxh3(&all, &none);
        let with_image = xxh3(&all, &image);
        assert_eq!(differing(&plain, &with_image), vec![1, 2, 3, 4, 5]);
        let direct: Vec<usize> = (0..6)
            .filter(|&i| rehash_with_parent_of(&with_image, i, &all, &none) != with_image[i])
            .collect();
        assert_eq!(direct, vec![1, 2, 3]);
    }

    #[test]
    fn multimodal_range_ending_on_a_unit_boundary_does_not_touch_the_next_unit() {
        let all = tokens(3 * UNIT);
        let image = ExtraKeys {
            multimodal: vec![MultimodalInput { start: 0, end: 16, hash: b"img0".to_vec() }],
            ..ExtraKeys::default()
        };
        let with_image = xxh3(&all, &image);
        let none = ExtraKeys::default();
        assert_ne!(rehash_with_parent_of(&with_image, 0, &all, &none), with_image[0]);
        assert_eq!(rehash_with_parent_of(&with_image, 1, &all, &none), with_image[1]);
    }

    #[test]
    fn multimodal_inputs_are_hashed_in_the_order_given() {
        let all = tokens(2 * UNIT);
        let a = MultimodalInput { start: 0, end: 8, hash: b"a".to_vec() };
        let b = MultimodalInput { start: 4, end: 12, hash: b"b".to_vec() };
        let ab = ExtraKeys { multimodal: vec![a.clone(), b.clone()], ..ExtraKeys::default() };
        let ba = ExtraKeys { multimodal: vec![b, a], ..ExtraKeys::default() };
        let mut unsorted = Vec::new();
        Hasher::new(HashAlgorithm::Xxh3_128, DEFAULT_SEED).extend(&all, UNIT, &ba, &mut unsorted);
        assert_ne!(xxh3(&all, &ab)[0], unsorted[0]);
    }

    #[test]
    fn hash_prefix_refuses_what_the_manager_refuses() {
        let all = tokens(2 * UNIT);
        let config = HashConfig::default();
        let input = |start, end, hash: &[u8]| MultimodalInput { start, end, hash: hash.to_vec() };
        let refused = [
            (vec![input(4, 12, b"b"), input(0, 8, b"a")], "in order of their start"),
            (vec![input(0, 8, b"a"), input(0, 4, b"b")], "in order of their start"),
            (vec![input(5, 5, b"x")], "empty"),
            (vec![input(0, 5, b"")], "empty hash"),
            (vec![input(0, 50, b"x")], "ends beyond the 32 tokens"),
        ];
        for (multimodal, expected) in refused {
            let extra = ExtraKeys { multimodal, ..ExtraKeys::default() };
            let error = hash_prefix(&config, &all, &extra).unwrap_err();
            assert!(error.to_string().contains(expected), "{error}");
        }
        let long_salt = ExtraKeys {
            cache_salt: Some(vec![1; MAX_EXTRA_KEY_BYTES + 1]),
            ..ExtraKeys::default()
        };
        assert!(hash_prefix(&config, &all, &long_salt).unwrap_err().to_string().contains("digest"));
        let many = ExtraKeys {
            multimodal: vec![input(0, 1, b"x"); MAX_MULTIMODAL_INPUTS + 1],
            ..ExtraKeys::default()
        };
        assert!(hash_prefix(&config, &all, &many).unwrap_err().to_string().contains("limit"));
        let zero_unit = HashConfig { unit: 0, ..HashConfig::default() };
        assert!(hash_prefix(&zero_unit, &all, &ExtraKeys::default()).is_err());
        let ties = ExtraKeys {
            multimodal: vec![input(0, 4, b"a"), input(0, 4, b"b"), input(0, 8, b"c")],
            ..ExtraKeys::default()
        };
        assert_eq!(hash_prefix(&config, &all, &ties).map(|d| d.len()), Ok(2));
    }

    #[test]
    fn length_prefixes_keep_adjacent_byte_strings_apart() {
        let all = tokens(UNIT);
        let split = |first: &[u8], second: &[u8]| ExtraKeys {
            multimodal: vec![
                MultimodalInput { start: 0, end: 4, hash: first.to_vec() },
                MultimodalInput { start: 0, end: 4, hash: second.to_vec() },
            ],
            ..ExtraKeys::default()
        };
        assert_ne!(xxh3(&all, &split(b"ab", b"c"))[0], xxh3(&all, &split(b"a", b"bc"))[0]);
    }

    #[test]
    fn sha256_blocks_is_sha256_whatever_the_blocks_held_before() {
        // Every padding case: lengths around each multiple of 64 (the 55/56-byte edge where the
        // length no longer fits the last block), one block list reused from longer and shorter
        // inputs so that stale bytes would show.
        let mut blocks = vec![ShaBlock::from([0xa5u8; 64]); 7];
        for len in (0..=300usize).chain((0..=300).rev()) {
            let input: Vec<u8> = (0..len).map(|i| (i * 131 + len) as u8).collect();
            assert_eq!(sha256_blocks(&input, &mut blocks), sha256_digest(&input), "length {len}");
        }
        // FIPS 180-4 example: SHA-256("abc").
        assert_eq!(
            sha256_blocks(b"abc", &mut blocks).to_hex(HashAlgorithm::Sha256),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn sha256_and_xxh3_digests_differ_and_have_their_own_lengths() {
        let all = tokens(2 * UNIT);
        let none = ExtraKeys::default();
        let fast = hashes(HashAlgorithm::Xxh3_128, 0, &all, &none);
        let strong = hashes(HashAlgorithm::Sha256, 0, &all, &none);
        assert_ne!(fast, strong);
        assert!(fast.iter().all(|d| d.0[16..] == [0u8; 16]));
        assert!(strong.iter().all(|d| d.0[16..] != [0u8; 16]));
        assert_eq!(fast[0].to_hex(HashAlgorithm::Xxh3_128).len(), 32);
        assert_eq!(strong[0].to_hex(HashAlgorithm::Sha256).len(), 64);
        assert_eq!(strong[0].as_bytes(HashAlgorithm::Sha256), &strong[0].0[..]);
    }

    #[test]
    fn seed_changes_every_digest() {
        let all = tokens(4 * UNIT);
        let none = ExtraKeys::default();
        for algorithm in [HashAlgorithm::Xxh3_128, HashAlgorithm::Sha256] {
            let zero = hashes(algorithm, 0, &all, &none);
            let other = hashes(algorithm, 42, &all, &none);
            assert_eq!(differing(&zero, &other), vec![0, 1, 2, 3]);
            assert_ne!(
                Hasher::new(algorithm, 0).seed_digest(),
                Hasher::new(algorithm, 42).seed_digest()
            );
        }
    }

    #[test]
    fn hash_unit_range_follows_the_token_count() {
        // With U = 4, unit 3 covers [12, 16): an input at [12, 13) reaches it, one at [11, 12) not.
        let mut hasher = Hasher::new(HashAlgorithm::Xxh3_128, 0);
        let parent = hasher.seed_digest();
        let unit = [1, 2, 3, 4];
        let at = |start, end| ExtraKeys {
            multimodal: vec![MultimodalInput { start, end, hash: b"x".to_vec() }],
            ..ExtraKeys::default()
        };
        let plain = hasher.hash_unit(&parent, 3, &unit, &ExtraKeys::default());
        assert_ne!(hasher.hash_unit(&parent, 3, &unit, &at(12, 13)), plain);
        assert_eq!(hasher.hash_unit(&parent, 3, &unit, &at(11, 12)), plain);
        assert_eq!(hasher.hash_unit(&parent, 3, &unit, &at(16, 20)), plain);
    }

    #[test]
    fn algorithm_names_round_trip() {
        for algorithm in [HashAlgorithm::Xxh3_128, HashAlgorithm::Sha256] {
            assert_eq!(HashAlgorithm::from_name(algorithm.name()), Some(algorithm));
        }
        assert_eq!(HashAlgorithm::from_name("md5"), None);
        assert_eq!(HashAlgorithm::Xxh3_128.digest_len(), 16);
        assert_eq!(HashAlgorithm::Sha256.digest_len(), 32);
    }

    #[test]
    fn default_config_is_xxh3_unit_16_with_the_default_seed() {
        let config = HashConfig::default();
        assert_eq!(config.algorithm, HashAlgorithm::Xxh3_128);
        assert_eq!(config.seed, DEFAULT_SEED);
        assert_eq!(config.unit, 16);
        assert!(!config.verify_tokens);
    }

    #[test]
    fn validate_accepts_well_formed_extra_keys() {
        let extra = ExtraKeys {
            cache_salt: Some(b"tenant".to_vec()),
            lora_id: Some(1),
            multimodal: vec![MultimodalInput { start: 0, end: 1, hash: vec![0] }],
        };
        assert_eq!(extra.validate(1000), Ok(()));
        assert!(!extra.is_empty());
        assert!(ExtraKeys::default().is_empty());
        assert_eq!(ExtraKeys::default().validate(0), Ok(()));
    }

    #[test]
    fn validate_rejects_an_empty_multimodal_range_and_says_how_to_fix_it() {
        for (start, end) in [(5, 5), (6, 5)] {
            let extra = ExtraKeys {
                multimodal: vec![
                    MultimodalInput { start: 0, end: 1, hash: vec![1] },
                    MultimodalInput { start, end, hash: vec![1] },
                ],
                ..ExtraKeys::default()
            };
            let message = extra.validate(1000).unwrap_err();
            assert!(message.contains("multimodal input 1"), "{message}");
            assert!(message.contains(&format!("[{start}, {end})")), "{message}");
            assert!(message.contains("start < end"), "{message}");
        }
    }

    #[test]
    fn validate_rejects_an_empty_multimodal_hash() {
        let extra = ExtraKeys {
            multimodal: vec![MultimodalInput { start: 0, end: 4, hash: Vec::new() }],
            ..ExtraKeys::default()
        };
        let message = extra.validate(1000).unwrap_err();
        assert!(message.contains("multimodal input 0 has an empty hash"), "{message}");
    }

    fn extra_keys() -> impl Strategy<Value = ExtraKeys> {
        let input = (0u32..200, 1u32..64, proptest::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(start, len, hash)| MultimodalInput { start, end: start + len, hash });
        (
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)),
            proptest::option::of(any::<u64>()),
            proptest::collection::vec(input, 0..3),
        )
            .prop_map(|(cache_salt, lora_id, multimodal)| ExtraKeys {
                cache_salt,
                lora_id,
                multimodal,
            })
    }

    proptest! {
        #[test]
        fn prop_extend_in_any_steps_equals_one_shot(
            all in proptest::collection::vec(0u32..1000, 0..200),
            cuts in proptest::collection::vec(0usize..200, 0..6),
            unit in 1u32..40,
            extra in extra_keys(),
            sha in any::<bool>(),
        ) {
            let algorithm = if sha { HashAlgorithm::Sha256 } else { HashAlgorithm::Xxh3_128 };
            let mut one_shot = Vec::new();
            Hasher::new(algorithm, 5).extend(&all, unit, &extra, &mut one_shot);
            let mut ends: Vec<usize> = cuts.into_iter().map(|c| c.min(all.len())).collect();
            ends.sort_unstable();
            ends.push(all.len());
            let mut hasher = Hasher::new(algorithm, 5);
            let mut incremental = Vec::new();
            for end in ends {
                hasher.extend(&all[..end], unit, &extra, &mut incremental);
            }
            prop_assert_eq!(incremental, one_shot);
        }
    }
}
