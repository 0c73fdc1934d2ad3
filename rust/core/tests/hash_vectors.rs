//! Test vectors of the version-1 byte encoding (docs/HASHING.md).
//!
//! The expected digests were computed once by the independent Python implementation printed in
//! docs/HASHING.md (the `xxhash` and `hashlib` modules), not by this crate. A failure here means
//! the encoding changed: every cache key, every external router and every stored event would
//! disagree with the previous release, so bump `ENCODING_VERSION` and publish new vectors instead
//! of editing these.

use prefixcache_core::hashing::{
    hash_prefix, Digest, ExtraKeys, HashAlgorithm, HashConfig, Hasher, MultimodalInput,
    DEFAULT_SEED, ENCODING_VERSION,
};

use HashAlgorithm::{Sha256, Xxh3_128};

fn config(algorithm: HashAlgorithm, seed: u64, unit: u32) -> HashConfig {
    HashConfig { algorithm, seed, unit, verify_tokens: false }
}

fn hex(algorithm: HashAlgorithm, digests: &[Digest]) -> Vec<String> {
    digests.iter().map(|digest| digest.to_hex(algorithm)).collect()
}

fn tokens_0_to_32() -> Vec<u32> {
    (0..32).collect()
}

fn salt_and_lora() -> ExtraKeys {
    ExtraKeys { cache_salt: Some(b"tenant-a".to_vec()), lora_id: Some(7), multimodal: Vec::new() }
}

fn image_at_10_to_20() -> ExtraKeys {
    ExtraKeys {
        multimodal: vec![MultimodalInput { start: 10, end: 20, hash: b"img0".to_vec() }],
        ..ExtraKeys::default()
    }
}

#[test]
fn encoding_version_and_default_seed_are_the_documented_ones() {
    assert_eq!(ENCODING_VERSION, 1);
    assert_eq!(DEFAULT_SEED, 0);
}

#[test]
fn seed_digests_match_the_reference() {
    let cases = [
        (Xxh3_128, 0, "eef0b02765dd3c02a6b9c6d1e5633704"),
        (Xxh3_128, 42, "daae2c88a64b8ea3b4784008facd6c22"),
        (Sha256, 0, "a4f6c6818200c4a7dce929480be7c4c5c11d3767bb0dd5728442669786ec9e0e"),
        (Sha256, 42, "68d98dfe4c2fc7d476b438ab1195f4dffdb739b97f3555d6dd1c7bb3737eaf5f"),
    ];
    for (algorithm, seed, expected) in cases {
        assert_eq!(Hasher::new(algorithm, seed).seed_digest().to_hex(algorithm), expected);
    }
}

#[test]
fn plain_tokens_match_the_reference() {
    let tokens = tokens_0_to_32();
    let none = ExtraKeys::default();
    assert_eq!(
        hex(Xxh3_128, &hash_prefix(&config(Xxh3_128, 0, 16), &tokens, &none).unwrap()),
        ["1d72a9d44c7c6f7dfd48830cad65b5bf", "da62b31b55051d8b772a25c1fe37ba0f"]
    );
    assert_eq!(
        hex(Sha256, &hash_prefix(&config(Sha256, 0, 16), &tokens, &none).unwrap()),
        [
            "3dce0ce6d7e67aef61ac809fc95f88f81b8cf7c51ed45f2fdbd7bb32109b48c6",
            "8eb122ce37268a8df79b885710164c11479bf2b6b478ff0ac95a2ea5b61dc61f",
        ]
    );
}

#[test]
fn seed_42_matches_the_reference() {
    let tokens = tokens_0_to_32();
    let none = ExtraKeys::default();
    assert_eq!(
        hex(Xxh3_128, &hash_prefix(&config(Xxh3_128, 42, 16), &tokens, &none).unwrap()),
        ["ea1e99faf7ded141ced44932437454c3", "65569577c865c92f7b9f5b93f9590985"]
    );
    assert_eq!(
        hex(Sha256, &hash_prefix(&config(Sha256, 42, 16), &tokens, &none).unwrap()),
        [
            "c9b7fac86344c8c128a668ede18556c7b16bde5df1a9a306b209755c0cc88533",
            "02e56b74305e64311386b3fd4f14f11f68815dbee0d166768c68d1f25c2d7a3b",
        ]
    );
}

#[test]
fn cache_salt_and_lora_id_match_the_reference() {
    let tokens = tokens_0_to_32();
    let extra = salt_and_lora();
    assert_eq!(
        hex(Xxh3_128, &hash_prefix(&config(Xxh3_128, 0, 16), &tokens, &extra).unwrap()),
        ["dd75d4630489853e0c0f61f8b529a910", "5f19d3859d27c1c72db4c7092e200d34"]
    );
    assert_eq!(
        hex(Sha256, &hash_prefix(&config(Sha256, 0, 16), &tokens, &extra).unwrap()),
        [
            "46e0d8973eb9f19a4b5af019c8fb206d16c56e1c9d6a2c47e467ad05d2a14622",
            "30b4780a1e5af48bf7cb3d6be5cb05f6fee5fb2a59ff787164c8dccc7974b093",
        ]
    );
}

#[test]
fn multimodal_input_matches_the_reference() {
    let tokens = tokens_0_to_32();
    let extra = image_at_10_to_20();
    assert_eq!(
        hex(Xxh3_128, &hash_prefix(&config(Xxh3_128, 0, 16), &tokens, &extra).unwrap()),
        ["fec780fa09a66a1f4d6218cca8b9f2d2", "07252b11a9b64f010e52d53599b7a367"]
    );
    assert_eq!(
        hex(Sha256, &hash_prefix(&config(Sha256, 0, 16), &tokens, &extra).unwrap()),
        [
            "f468a002eae0af7711fbfc29eba462cc19184270b200ee898c6b06b02cd97054",
            "067b8b38c7611b121f6f727e44e557f7f99c8ed805842a3ce8eecd5dc234ac94",
        ]
    );
}

#[test]
fn long_units_match_the_reference() {
    // 537-byte inputs: XXH3's long-input path, and token values that use three bytes.
    let tokens: Vec<u32> = (150_000..150_256).collect();
    let none = ExtraKeys::default();
    assert_eq!(
        hex(Xxh3_128, &hash_prefix(&config(Xxh3_128, 0, 128), &tokens, &none).unwrap()),
        ["3dd372b00db59c857256cf99964d7fc7", "12a5e547ce957fe441b806df0fa6c9e8"]
    );
    assert_eq!(
        hex(Sha256, &hash_prefix(&config(Sha256, 0, 128), &tokens, &none).unwrap()),
        [
            "f38bf5fc047e5b6fd8e6887d408d0668fc7d9ec5d9fe741d7856562997622ba9",
            "ad6b3f7d0b04f2f988bd75b3552b690e31ba696301e5d58db108f878beec598a",
        ]
    );
}

#[test]
fn incremental_hashing_reproduces_the_vectors() {
    let tokens = tokens_0_to_32();
    let extra = salt_and_lora();
    for algorithm in [Xxh3_128, Sha256] {
        let mut hasher = Hasher::new(algorithm, 0);
        let mut digests = Vec::new();
        for end in [5, 16, 31, 32] {
            hasher.extend(&tokens[..end], 16, &extra, &mut digests);
        }
        assert_eq!(digests, hash_prefix(&config(algorithm, 0, 16), &tokens, &extra).unwrap());
    }
}

#[test]
fn xxh3_digest_is_the_little_endian_u128_followed_by_zeros() {
    let mut seed_input = b"prefixcache".to_vec();
    seed_input.extend_from_slice(&0u64.to_le_bytes());
    let expected = xxhash_rust::xxh3::xxh3_128(&seed_input).to_le_bytes();
    let digest = Hasher::new(Xxh3_128, 0).seed_digest();
    assert_eq!(digest.as_bytes(Xxh3_128), expected);
    assert_eq!(digest.0[16..], [0u8; 16]);
}
