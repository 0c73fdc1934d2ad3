"""docs/HASHING.md (encoding version 1) written independently in plain Python,
for the tests that check the Rust hasher against the specification (test_hashing.py, the API
fuzzer). xxh3_128 uses the `xxhash` package (in the test extras: `pip install -e '.[test]'`),
so a run without it fails instead of leaving the default algorithm unchecked."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import xxhash


def reference(
    tokens: list[int],
    unit: int,
    algorithm: str = "sha256",
    seed: int = 0,
    cache_salt: bytes | None = None,
    lora_id: int | None = None,
    multimodal: Iterable[tuple[int, int, bytes]] = (),
) -> list[bytes]:
    """The digest of every full unit of `tokens`, byte for byte as docs/HASHING.md specifies."""

    def digest(data: bytes) -> bytes:
        if algorithm == "sha256":
            return hashlib.sha256(data).digest()
        return int(xxhash.xxh3_128_intdigest(data, seed=0)).to_bytes(16, "little")

    inputs = list(multimodal)
    parent = digest(b"prefixcache" + struct.pack("<Q", seed))
    out = []
    for i in range(len(tokens) // unit):
        unit_tokens = tokens[i * unit : (i + 1) * unit]
        entries = []
        if i == 0 and cache_salt is not None:
            entries.append((1, cache_salt))
        if lora_id is not None:
            entries.append((2, struct.pack("<Q", lora_id)))
        entries += [(3, h) for start, end, h in inputs if start < (i + 1) * unit and end > i * unit]
        data = bytes([1]) + parent  # ENCODING_VERSION
        data += struct.pack(f"<I{len(unit_tokens)}I", len(unit_tokens), *unit_tokens)
        data += struct.pack("<I", len(entries))
        for tag, payload in entries:
            data += struct.pack("<BI", tag, len(payload)) + payload
        parent = digest(data)
        out.append(parent)
    return out
