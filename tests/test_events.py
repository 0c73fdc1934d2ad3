"""KV events on the wire: the manager's batches in vLLM 0.33's format, and the ZMQ publisher.

The rules checked here, stated independently of the implementation:

* a batch is the msgpack array ``[ts, [events...], data_parallel_rank]``; each event is a map
  whose first key is ``type``; a store carries ``block_hashes``, ``parent_block_hash``,
  ``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name`` even when nil;
* a hash on the wire is the low 64 bits of the big-endian ``hash_prefix`` digest of the
  prefix ending at that block; a store's parent is the hash of the block before its first
  (nil at the start of the sequence); its token ids are exactly the stored blocks' tokens;
* the wire block is the hash unit unless ``event_block_size`` names a paged block size;
* an eviction removes on the wire only keys that no block serves any more;
* the payload decodes with structs mirroring vLLM 0.33's, and re-encoding it with them gives
  the same bytes (so vLLM's own decoder and any router reading vLLM reads it the same);
* the publisher sends 3 frames (topic, 8-byte big-endian sequence from 0, payload), replays
  buffered batches from a requested sequence followed by the end marker, and never blocks
  when its queue is full (it counts the drop).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import prefixcache as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

msgpack = pytest.importorskip("msgpack")
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from prefixcache import events as ev  # noqa: E402

# The wire format's test vector, encoded by vLLM 0.33.0's own structs.
VECTOR = bytes.fromhex(
    "93cb3ff800000000000093de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7391cf1234567890abcdefb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394010203"
    "04aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0"
    "a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f"
    "6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf1234567890abcdefa6"
    "6d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c6561726564"
    "00"
)


# --- structs mirroring vLLM 0.33's vllm/distributed/kv_events.py ------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def test_vllm_structs_encode_the_test_vector() -> None:
    """The mirror structs are vLLM's: they give the test vector's bytes (the contract's anchor)."""
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[0x1234567890ABCDEF],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved(block_hashes=[0x1234567890ABCDEF], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert ENCODER.encode(batch) == VECTOR
    assert DECODER.decode(VECTOR) == batch


def full(unit: int = 4, block: int = 8, blocks: int = 64, **kw: Any) -> pc.CacheManager:
    return pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(blocks)],
            groups=[pc.FullAttention(block)],
            hash=pc.HashConfig(unit=unit),
            **kw,
        )
    )


def run(mgr: pc.CacheManager, seq: int, tokens: list[int], extra: Any = None) -> None:
    """Adds, prefills in one step and commits ``tokens``."""
    mgr.add(seq, tokens, extra)
    assert mgr.schedule(seq, len(tokens)) is not None
    mgr.commit(mgr.build_plan())


def wire(mgr: pc.CacheManager, rank: int | None = 0) -> KVEventBatch:
    payload, taken, written = mgr.drain_events_wire(12.25, rank)
    assert payload is not None and taken >= written > 0
    batch = DECODER.decode(payload)
    # Re-encoding with vLLM's structs gives the same bytes: field order, headers, nil fields.
    assert ENCODER.encode(batch) == payload
    assert batch.ts == 12.25 and batch.data_parallel_rank == rank
    assert len(batch.events) == written
    return batch


def ids(tokens: list[int], unit: int, extra: pc.ExtraKeys | None = None) -> list[int]:
    return [ev.wire_id(d) for d in pc.hash_prefix(tokens, unit=unit, extra_keys=extra)]


def test_a_commit_is_one_run_with_its_tokens_and_parent() -> None:
    mgr = full()
    tokens = list(range(100, 122))  # 22 tokens: 5 units of 4, across 3 blocks of 8
    run(mgr, 1, tokens)
    (stored,) = wire(mgr).events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == ids(tokens, 4)
    assert stored.parent_block_hash is None
    assert stored.token_ids == tokens[:20]
    assert (stored.block_size, stored.medium, stored.lora_id, stored.lora_name) == (
        4,
        "GPU",
        None,
        None,
    )
    assert (stored.group_idx, stored.kv_cache_spec_kind) == (0, "full_attention")
    assert all(h != 0 for h in stored.block_hashes)
    # The next chunk continues the chain: its parent is the last block sent.
    mgr.append(1, list(range(122, 130)))
    assert mgr.schedule(1, 100) is not None
    mgr.commit(mgr.build_plan())
    (more,) = wire(mgr).events
    assert isinstance(more, BlockStored)
    every = ids(tokens + list(range(122, 130)), 4)
    assert more.parent_block_hash == every[4]
    assert more.block_hashes == every[5:]
    assert more.token_ids == list(range(120, 128))


def test_the_wire_block_can_be_the_paged_block() -> None:
    mgr = full(event_block_size=8)
    tokens = list(range(7, 29))
    run(mgr, 1, tokens)
    (stored,) = wire(mgr).events
    every = ids(tokens, 4)
    assert stored.block_size == 8
    assert stored.block_hashes == [every[1], every[3]]  # prefixes of 8 and 16 tokens
    assert stored.token_ids == tokens[:16]
    assert stored.parent_block_hash is None
    with pytest.raises(pc.ConfigError, match="event_block_size"):
        full(event_block_size=12)


def test_extending_mid_block_sends_the_whole_wire_block() -> None:
    """A run that starts inside a wire block (hit at U) still sends every block's tokens."""
    mgr = full(event_block_size=8)
    run(mgr, 1, list(range(12)))  # keys at 4, 8, 12; wire block 0..8 only
    (first,) = wire(mgr).events
    mgr.finish(1)
    tokens = [*list(range(12)), 50, 51, 52, 53, 54]
    mgr.add(2, tokens)
    s = mgr.schedule(2, 100)
    assert s is not None and s.num_computed == 12  # the run starts inside wire block 8..16
    mgr.commit(mgr.build_plan())
    (second,) = wire(mgr).events
    every = ids(tokens, 4)
    assert second.block_hashes == [every[3]]
    assert second.parent_block_hash == first.block_hashes[-1] == every[1]
    assert second.token_ids == tokens[8:16]


def test_salt_and_lora_are_on_the_wire() -> None:
    mgr = full()
    tokens = list(range(8))
    extra = pc.ExtraKeys(cache_salt=b"tenant-a", lora_id=3)
    run(mgr, 1, tokens, extra)
    (stored,) = wire(mgr).events
    assert stored.lora_id == 3
    # The salt is part of the first block's key only: vLLM's extra_keys, one entry per block.
    assert stored.extra_keys == [("tenant-a",), None]
    assert stored.block_hashes == ids(tokens, 4, extra)
    assert stored.block_hashes != ids(tokens, 4)


def vllm_block_extra_keys(
    block_start: int, block_size: int, images: list[tuple[int, int, str]], salt: str | None
) -> tuple[Any, ...] | None:
    """vLLM's event extra keys of one block, stated from its rule: every multimodal input that
    overlaps the block, as (identifier, its offset less the block's start), then the salt on
    the sequence's first block; None when there is none."""
    end = block_start + block_size
    keys: list[Any] = [(h, s - block_start) for s, e, h in images if s < end and e > block_start]
    if salt is not None and block_start == 0:
        keys.append(salt)
    return tuple(keys) or None


def test_multimodal_inputs_are_in_each_overlapping_blocks_extra_keys() -> None:
    """A router hashing `[parent, tokens, extra]` (llm-d) tells two images apart only when each
    block names the inputs it holds: the same tokens with another image are another prefix."""
    images = [(3, 13, "img-a"), (13, 14, "img-b"), (30, 42, "img-c")]
    tokens = list(range(44))
    for salt in (None, "tenant-a"):
        mgr = full(unit=4, block=8, event_block_size=8)
        extra = pc.ExtraKeys(
            cache_salt=None if salt is None else salt.encode(),
            multimodal=[pc.MultimodalInput(s, e, h.encode()) for s, e, h in images],
        )
        # Two steps, so that the second run starts inside a wire block and extends a run.
        mgr.add(1, tokens, extra)
        assert mgr.schedule(1, 20) is not None
        mgr.commit(mgr.build_plan())
        assert mgr.schedule(1, 100) is not None
        mgr.commit(mgr.build_plan())
        events = [e for e in wire(mgr).events if isinstance(e, BlockStored)]
        got = [
            None if k is None else tuple(tuple(x) if isinstance(x, list) else x for x in k)
            for e in events
            for k in (e.extra_keys or [None] * len(e.block_hashes))
        ]  # msgpack has one array type: vLLM's inner tuples decode as lists
        want = [vllm_block_extra_keys(b * 8, 8, images, salt) for b in range(40 // 8)]
        assert got == want, salt
        assert [h for e in events for h in e.block_hashes] == ids(tokens, 4, extra)[1:10:2]
    # Without multimodal inputs or salt no block carries the key at all.
    mgr = full()
    run(mgr, 1, list(range(16)))
    (stored,) = wire(mgr).events
    assert stored.extra_keys is None


def test_state_groups_are_mamba_with_their_position() -> None:
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(64), pc.PoolConfig(32)],
            groups=[pc.FullAttention(8, pool=0), pc.StateGroup(alignment=4, pool=1)],
            hash=pc.HashConfig(unit=4),
        )
    )
    run(mgr, 1, list(range(21)))
    payload, _, _ = mgr.drain_events_wire(0.0)
    assert payload is not None
    raw = msgpack.unpackb(payload)
    kinds = {e["kv_cache_spec_kind"] for e in raw[1]}
    assert kinds == {"full_attention", "mamba"}, raw
    for e in raw[1]:
        if e["kv_cache_spec_kind"] == "mamba":
            assert e["group_idx"] == 1 and len(e["block_hashes"]) == 1
            assert e["position"] % 4 == 0 and len(e["token_ids"]) == 4
    DECODER.decode(payload)  # vLLM's decoder ignores the extra key


def test_removal_only_of_keys_no_block_serves() -> None:
    """Two copies of one key: evicting the first changes nothing on the wire, the second
    removes it."""
    mgr = full(unit=4, block=4, blocks=5)  # 4 usable blocks of one unit each
    tokens = list(range(8))
    run(mgr, 1, tokens)  # blocks b1 (key at 4), b2 (key at 8)
    mgr.add(2, tokens)
    s = mgr.schedule(2, 8)
    assert s is not None and s.num_computed == 4  # shares b1, computes a copy of the key at 8
    mgr.commit(mgr.build_plan())
    wire(mgr)
    mgr.finish(1)
    mgr.finish(2)
    run(mgr, 3, list(range(500, 508)))  # the free block and the oldest copy of the key at 8
    assert mgr.stats().evictions == 1
    assert not [e for e in wire(mgr).events if isinstance(e, BlockRemoved)]
    assert mgr.add(9, [*tokens, 1]) is not None and mgr.lookup(9).tokens == 8
    mgr.finish(9)
    run(mgr, 4, list(range(600, 608)))  # the last copy of the key at 8, then the key at 4
    assert mgr.stats().evictions == 3
    removed = [e.block_hashes for e in wire(mgr).events if isinstance(e, BlockRemoved)]
    every = ids(tokens, 4)
    assert removed == [[every[1]], [every[0]]]


def test_reset_is_all_blocks_cleared() -> None:
    mgr = full()
    run(mgr, 1, list(range(8)))
    mgr.finish(1)
    wire(mgr)
    mgr.reset()
    (cleared,) = wire(mgr).events
    assert isinstance(cleared, AllBlocksCleared)


def test_nothing_pending_gives_no_payload() -> None:
    mgr = full()
    assert mgr.drain_events_wire(0.0) == (None, 0, 0)


def test_wire_id() -> None:
    assert ev.wire_id(bytes(8) + (5).to_bytes(8, "big")) == 5
    assert ev.wire_id((7).to_bytes(8, "big") + bytes(8)) == 7
    assert ev.wire_id(bytes(16)) == 1
    assert ev.offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert ev.offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert ev.offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"
    assert ev.offset_endpoint_port(None, 3) is None
    assert ev.cleared_payload(1.5, 0) == ENCODER.encode(
        KVEventBatch(ts=1.5, events=[AllBlocksCleared()], data_parallel_rank=0)
    )
    assert ev.cleared_payload(1.5, 300) == ENCODER.encode(
        KVEventBatch(ts=1.5, events=[AllBlocksCleared()], data_parallel_rank=300)
    )


# --- the bytes, pinned --------------------------------------------------------------------------


def _widths(n: int, seed: int) -> list[int]:
    """``n`` token ids of every msgpack width (fixint, uint8, uint16, uint32), from an LCG."""
    edges = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 150_000, 2**31 - 1, 2**32 - 1]
    out, x = [], seed
    for _ in range(n):
        x = (x * 6_364_136_223_846_793_005 + 1_442_695_040_888_963_407) % 2**64
        width = [128, 256, 65_536, 2**32][x >> 62]
        out.append(edges[(x >> 32) % len(edges)] if (x >> 61) & 1 else (x >> 20) % width)
    return out


def _prefill(mgr: pc.CacheManager, seq: int, tokens: list[int], extra: Any, chunk: int) -> None:
    mgr.add(seq, tokens, extra)
    while mgr.num_computed(seq) < len(tokens):
        assert mgr.schedule(seq, chunk) is not None
        mgr.commit(mgr.build_plan())


def golden_payloads() -> list[bytes]:
    """Wire batches of a fixed workload that reaches every form the encoder writes: tokens and
    ids of each integer width, arrays of 16+ and 65,536+ entries, str8 / str16 / bin salts and
    multimodal hashes, LoRA ids, W = U and W > U, sliding-window and mamba groups, evictions
    of shared and last copies, a reset, sha256 digests, ranks nil / negative / wide."""
    payloads: list[bytes] = []
    ranks = [None, 0, 5, 127, 128, -1, -32, -33, -200, -40_000, 2**40, -(2**40)]

    def drain(mgr: pc.CacheManager) -> None:
        rank = ranks[len(payloads) % len(ranks)]
        payload, taken, written = mgr.drain_events_wire(0.25 * len(payloads) - 3.0, rank)
        assert (payload is None) == (written == 0) and taken >= written
        if payload is not None:
            payloads.append(payload)

    salts = [b"tenant-a", b"s" * 40, "ü".encode() * 150, b"\xff\xfe"]
    loras = [None, 0, 127, 128, 2**16, 2**33, 2**64 - 1]
    images = [b"img-a", b"\x80\x81", b"h" * 33]
    configs = [
        dict(groups=[pc.FullAttention(4)], hash=pc.HashConfig(unit=4), pools=[pc.PoolConfig(40)]),
        dict(
            groups=[
                pc.FullAttention(8, pool=0),
                pc.SlidingWindow(8, 16, pool=0),
                pc.StateGroup(alignment=4, pool=1),
            ],
            hash=pc.HashConfig(unit=4),
            pools=[pc.PoolConfig(90), pc.PoolConfig(40)],
            event_block_size=8,
        ),
        dict(
            groups=[pc.FullAttention(16)],
            hash=pc.HashConfig(unit=8, algorithm="sha256"),
            pools=[pc.PoolConfig(30)],
            event_block_size=16,
        ),
    ]
    for c, config in enumerate(configs):
        mgr = pc.CacheManager(pc.CacheConfig(**config))  # type: ignore[arg-type]
        base = _widths(40, seed=c)
        for s in range(12):
            tokens = base[: 8 + (s * 5) % 33] + _widths(s % 7, seed=100 * c + s)
            extra = pc.ExtraKeys(
                cache_salt=salts[s // 3 % len(salts)] if s % 3 == 0 else None,
                lora_id=loras[s % len(loras)],
                multimodal=[
                    pc.MultimodalInput(2, 7, images[s % 3]),
                    pc.MultimodalInput(9, 10, b"x"),
                ]
                if s % 4 == 1 and len(tokens) > 10
                else [],
            )
            _prefill(mgr, s, tokens, extra, chunk=5 + s % 9)
            for t in range(s % 4):
                mgr.append(s, [_widths(1, seed=s * 10 + t)[0]])
                assert mgr.schedule(s, 1) is not None
                mgr.commit(mgr.build_plan())
            if s % 2:
                drain(mgr)
            if s >= 2:
                mgr.finish(s - 2)
        drain(mgr)
        mgr.finish(10)
        mgr.finish(11)
        mgr.reset()
        drain(mgr)
    # One run of 70,000 tokens: 4,375 ids (array16) and token ids in an array32.
    mgr = full(unit=16, block=16, blocks=4400)
    _prefill(mgr, 1, _widths(70_000, seed=7), None, chunk=70_000)
    drain(mgr)
    return payloads


GOLDEN_SIZE = (21, 264_852)
GOLDEN_SHA256 = "ba577a0a29a018d675b8f9dee7f9844dc13a3dcf2690380300c46d56985a24c6"


def test_wire_bytes_are_pinned() -> None:
    """The payloads of a fixed workload, byte for byte as the encoder wrote them when vLLM's
    structs and Dynamo's indexer were checked against it (b5d5151), and each one the bytes
    vLLM's structs re-encode (those with a mamba group's extra key aside)."""
    payloads = golden_payloads()
    for payload in payloads:
        if b"\xa5mamba" not in payload:
            assert ENCODER.encode(DECODER.decode(payload)) == payload
    digest = hashlib.sha256(b"".join(len(p).to_bytes(4, "big") + p for p in payloads))
    assert (len(payloads), sum(map(len, payloads))) == GOLDEN_SIZE
    assert digest.hexdigest() == GOLDEN_SHA256


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(["full", "sliding", "state"]),
    unit=st.sampled_from([2, 4]),
    wide=st.booleans(),
    ops=st.lists(
        st.tuples(
            st.integers(0, 5),  # sequence id
            st.integers(0, 24),  # tokens shared with the common prefix
            st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=30),
            st.sampled_from([None, b"t", b"\xff" * 40]),
            st.sampled_from([None, 1, 300, 2**64 - 1]),
            st.sampled_from([None, 0, -7, 2**20]),  # drain with this rank (None: no drain)
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_every_payload_is_what_vllms_structs_encode(
    layout: str, unit: int, wide: bool, ops: list[Any]
) -> None:
    """Any workload (evictions, shared prefixes, salts, LoRA ids, token ids of every width):
    every payload decodes with vLLM's structs into the bytes they re-encode, each store sends
    exactly its blocks' tokens, and a drain's counts are the payload's."""
    block = 2 * unit * (2 if wide else 1)
    groups: list[Any] = [pc.FullAttention(block)]
    if layout == "sliding":
        groups.append(pc.SlidingWindow(block, 2 * block))
    if layout == "state":
        groups.append(pc.StateGroup(alignment=unit, pool=1))
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(24), pc.PoolConfig(12)],
            groups=groups,
            hash=pc.HashConfig(unit=unit),
            event_block_size=block if wide else None,
        )
    )
    w = block if wide else unit
    common = list(range(1000, 1024))
    live: set[int] = set()

    def check(rank: int | None) -> None:
        payload, taken, written = mgr.drain_events_wire(1.5, rank)
        assert (payload is None) == (written == 0) and taken >= written
        if payload is None:
            return
        raw = msgpack.unpackb(payload)
        assert len(raw[1]) == written and raw[2] == rank
        for e in raw[1]:
            if e["type"] == "BlockStored":
                assert e["block_size"] == w
                assert len(e["token_ids"]) == w * len(e["block_hashes"])
        if layout != "state":
            assert ENCODER.encode(DECODER.decode(payload)) == payload

    for seq, shared, tail, salt, lora, rank in ops:
        if seq in live:
            mgr.finish(seq)
            live.discard(seq)
        tokens = common[:shared] + tail
        mgr.add(seq, tokens, pc.ExtraKeys(cache_salt=salt, lora_id=lora))
        live.add(seq)
        if mgr.schedule(seq, len(tokens)) is None:
            mgr.finish(seq)
            live.discard(seq)
        else:
            mgr.commit(mgr.build_plan())
        if rank is not None:
            check(rank)
    check(None)


# --- the publisher ------------------------------------------------------------------------------


@pytest.fixture
def ctx() -> Any:
    """A ZMQ context destroyed with linger 0 however the test ends (an open socket would
    otherwise make its garbage collection wait forever)."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscriber(ctx: Any, endpoint: str) -> Any:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 30_000)
    sub.connect(endpoint)
    return sub


def test_publisher_frames_sequence_and_replay(tmp_path: Any, ctx: Any) -> None:
    mgr = full()
    config = ev.KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv@pod@model",
    )
    with ev.ZmqEventPublisher(mgr, config, data_parallel_rank=0, context=ctx) as pub:
        sub = subscriber(ctx, config.endpoint)
        # PUB drops until the subscription has propagated: publish probes until one arrives.
        deadline = time.time() + 30
        probes = 0
        while True:
            pub.publish_payload(ev.cleared_payload(0.0, 0), 1)
            probes += 1
            if sub.poll(20):
                break
            assert time.time() < deadline, "the subscriber never received a batch"
        first_real = probes  # the probes took sequence numbers 0 .. probes - 1
        run(mgr, 1, list(range(12)))
        assert pub.publish() == 1
        mgr.finish(1)
        run(mgr, 2, list(range(40, 48)))
        assert pub.publish() == 1
        got = []
        while len(got) < 2:
            frames = sub.recv_multipart()
            if int.from_bytes(frames[1], "big") >= first_real:
                got.append(frames)
        for i, (topic, seq, payload) in enumerate(got):
            assert topic == b"kv@pod@model"
            assert len(seq) == 8 and int.from_bytes(seq, "big") == first_real + i
            DECODER.decode(payload)
        # Replay from the first real batch: both, in order, then the end marker.
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 30_000)
        dealer.connect(config.replay_endpoint)
        dealer.send_multipart([b"", first_real.to_bytes(8, "big")])
        replies = []
        while True:
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == ev.END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                break
            replies.append(frames[1:])
        assert replies == [list(g) for g in got]
        stats = pub.stats()
        assert stats.replays == 1 and stats.batches_replayed == 2
        assert stats.batches_dropped == 0


def test_publisher_never_blocks_on_a_full_queue(tmp_path: Any, ctx: Any) -> None:
    mgr = full()
    config = ev.KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub", max_queue_size=1)
    pub = ev.ZmqEventPublisher(mgr, config, context=ctx)
    # The sender takes the counters' lock after each send: holding it stalls the sender, so
    # the queue fills; publish must return at once and count the drop.
    with pub._counters.lock:
        started = time.perf_counter()
        results = [pub.publish_payload(ev.cleared_payload(0.0), 1) for _ in range(50)]
        assert time.perf_counter() - started < 1.0
    assert results.count(0) >= 48  # at most the sender's batch and one queued got through
    pub.close()
    stats = pub.stats()
    assert stats.batches_dropped == results.count(0)
    assert stats.batches_published + stats.batches_dropped == 50


def test_data_parallel_rank_offsets_the_port_and_stamps_batches(ctx: Any) -> None:
    mgr = full()
    sock = ctx.socket(zmq.SUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    # Rank 2 of a base port two below the subscriber's: the publisher connects to `port`.
    config = ev.KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port - 2}")
    with ev.ZmqEventPublisher(mgr, config, data_parallel_rank=2, context=ctx) as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        deadline = time.time() + 30
        while not sock.poll(20):
            pub.publish_payload(ev.cleared_payload(0.0, 2), 1)
            assert time.time() < deadline
        run(mgr, 1, list(range(8)))
        pub.publish()
        while True:
            _, _, payload = sock.recv_multipart()
            batch = DECODER.decode(payload)
            assert batch.data_parallel_rank == 2
            if any(isinstance(e, BlockStored) for e in batch.events):
                break


def test_publisher_refuses_a_manager_without_events() -> None:
    with pytest.raises(ValueError, match="enable_events"):
        ev.ZmqEventPublisher(full(enable_events=False), ev.KVEventsConfig(endpoint="inproc://x"))
    assert isinstance(ev.create_publisher(full(), None), ev.NullEventPublisher)
