"""A real consumer of prefixcache's KV events: NVIDIA Dynamo's standalone indexer
(``ai-dynamo-runtime==1.6.1``, ``python -m dynamo.indexer``) subscribed on loopback.

The rule checked: for full attention with the wire block equal to the hash unit U and to the
indexer's block size, the tokens the indexer says a probe prompt has cached on this replica
equal the full-attention hit ``lookup`` returns for it (for prompts whose length is not a
multiple of U, where the lookup's cap of one recomputed token does not bite), after stores
with shared prefixes and evictions, after a reset, and after a batch lost on the wire (a
sequence gap the indexer repairs from the replay socket); and after the reference engine has
served a growing-prefix workload with evictions while its manager published.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import prefixcache as pc
import pytest

if importlib.util.find_spec("zmq") is None or importlib.util.find_spec("dynamo") is None:
    pytest.skip(
        "ai-dynamo-runtime==1.6.1 (and pyzmq) are not installed: pip install "
        "'prefixcache[test]' installs them where the wheel exists (Linux x86_64 / aarch64)",
        allow_module_level=True,
    )
if importlib.util.find_spec("dynamo.indexer") is None:
    pytest.skip("this ai-dynamo-runtime build has no dynamo.indexer", allow_module_level=True)

from prefixcache import events as ev

UNIT = 4
BLOCK = 8


class LoseOne:
    """A PUB socket that loses the next message it is given (as a network would)."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.lost: list[Any] = []

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.lost:
            self.lost.append(frames)
            return None
        return self.socket.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Indexer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 60
        while True:
            try:
                self.request("/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("dynamo.indexer did not start") from None
                time.sleep(0.1)

    def request(self, path: str, body: Any = None) -> Any:
        # The indexer's HTTP server binds every interface: talk to it on loopback only.
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as reply:
            text = reply.read().decode()
        return json.loads(text) if text else None

    def matched(self, tokens: list[int]) -> int:
        reply = self.request("/query", {"token_ids": tokens, "model_name": "default"})
        instance = reply.get("instances", {}).get("1")
        return 0 if instance is None else int(instance["gpu"])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def setup() -> Any:
    pub_port, replay_port = free_port(), free_port()
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(16)],  # 15 usable blocks of 8 tokens: the workload evicts
            groups=[pc.FullAttention(BLOCK)],
            hash=pc.HashConfig(unit=UNIT),
        )
    )
    config = ev.KVEventsConfig(
        endpoint=f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
    )
    pub = ev.ZmqEventPublisher(mgr, config, bind=True)
    indexer = Indexer(free_port())
    indexer.request(
        "/register",
        {
            "instance_id": 1,
            "endpoint": config.endpoint,
            "replay_endpoint": config.replay_endpoint,
            "model_name": "default",
            "block_size": UNIT,
        },
    )
    try:
        yield mgr, pub, indexer
    finally:
        pub.close()
        indexer.close()


def serve(mgr: pc.CacheManager, pub: ev.ZmqEventPublisher, seq: int, tokens: list[int]) -> None:
    mgr.add(seq, tokens)
    while mgr.num_computed(seq) < len(tokens):
        assert mgr.schedule(seq, 16) is not None
        mgr.commit(mgr.build_plan())
        pub.publish()
    mgr.finish(seq)
    pub.publish()


def lookup(mgr: pc.CacheManager, tokens: list[int]) -> int:
    probe = 10**6 + len(tokens) + sum(tokens) % 1000
    mgr.add(probe, tokens)
    hit = mgr.lookup(probe).groups[0].tokens
    mgr.finish(probe)
    return hit


def agree(mgr: pc.CacheManager, indexer: Indexer, probes: list[list[int]]) -> None:
    """Waits (up to 20 s, events travel asynchronously) until the indexer's answer for every
    probe is the lookup's, then asserts it."""
    want = [lookup(mgr, p) for p in probes]
    deadline = time.time() + 20
    while True:
        got = [indexer.matched(p) for p in probes]
        if got == want or time.time() > deadline:
            break
        time.sleep(0.1)
    assert got == want
    assert all(len(p) % UNIT for p in probes)


def family(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def test_the_indexer_matches_lookup(setup: Any) -> None:
    mgr, pub, indexer = setup
    # Wait until the indexer is subscribed (a PUB socket drops what it sends before): stores
    # of fresh prompts until one is seen.
    deadline = time.time() + 30
    for k in range(1000):
        warm = family(9000 + 100 * k, 13)
        serve(mgr, pub, 1 + k, warm)
        time.sleep(0.2)
        if indexer.matched(warm) > 0:
            break
        assert time.time() < deadline, "the indexer never received a batch"

    system = family(0, 40)
    prompts = [
        system + family(100, 21),
        system + family(200, 33),
        system[:24] + family(300, 17),
        family(400, 50),
        system + family(100, 9) + family(500, 11),
    ]
    probes = [p + [7] * (1 + i % 3) for i, p in enumerate(prompts)]
    probes = [p + [7] * (len(p) % UNIT == 0) for p in probes]
    probes += [system[:26], [*system, 1], family(400, 23), family(600, 9)]
    for i, p in enumerate(prompts):
        serve(mgr, pub, 10 + i, p)
    assert mgr.stats().evictions > 0, "the workload was meant to evict"
    agree(mgr, indexer, probes)
    assert any(lookup(mgr, p) > 0 for p in probes), "nothing left cached to compare"

    # A reset clears the indexer's view.
    mgr.reset()
    pub.publish()
    agree(mgr, indexer, probes)
    assert all(lookup(mgr, p) == 0 for p in probes)

    # A batch lost on the wire (kept for replay): the next one shows the gap, the indexer
    # asks the replay socket for what it missed.
    pub._pub = LoseOne(pub._pub)
    serve(mgr, pub, 30, prompts[0])  # its batches: the first is lost
    serve(mgr, pub, 31, prompts[3])
    agree(mgr, indexer, probes)
    assert pub._pub.lost, "no batch was lost"
    assert lookup(mgr, probes[0]) > 0
    assert pub.stats().replays >= 1, "the indexer never asked for a replay"


def test_the_indexer_follows_the_reference_engine(setup: Any) -> None:
    """The reference engine serving a growing-prefix workload with evictions (block policy:
    U = B, the indexer's block size) while its manager publishes: afterwards the indexer's
    matched tokens for every prompt of the workload, and for extensions of them, equal the
    full-attention hit ``lookup`` returns on the engine's final manager."""
    from prefixcache.engine import Engine, EngineConfig, Policy, build_model
    from prefixcache.engine.policy import PAGED_GROUP
    from prefixcache.engine.workloads import Geometry, GrowingPrefixSpec, PresetWorkload

    mgr, pub, indexer = setup
    deadline = time.time() + 30
    for k in range(1000):  # wait until the indexer is subscribed (see the test above)
        warm = family(9000 + 100 * k, 13)
        serve(mgr, pub, 1 + k, warm)
        time.sleep(0.2)
        if indexer.matched(warm) > 0:
            break
        assert time.time() < deadline, "the indexer never received a batch"

    model = build_model("cpu", "torch")
    geometry = Geometry(block_size=UNIT, unit=UNIT, token_budget=32, max_running=2)
    assert geometry.aligned(model.backend.checkpoint_alignment) == geometry
    spec = GrowingPrefixSpec(streams=2, first_prompt=30, growth=14, rounds=4, output_len=3)
    workload = PresetWorkload("dynamo", "test", spec, geometry)
    engines: list[pc.CacheManager] = []

    def observe(manager: pc.CacheManager) -> Any:
        engines.append(manager)
        pub.attach(manager)
        return pub.publish

    config = EngineConfig(token_budget=32, max_running=2, paged_blocks=40, state_blocks=64)
    engine = Engine(
        model, Policy.named("block", block_size=UNIT, fine_unit=UNIT), config, observe=observe
    )
    built = workload.build(model.config.vocab_size)
    prompts = [request.prompt.tolist() for request in built.initial_requests()]
    result = engine.run(built)
    assert result.manager_stats["evictions"] > 0, "the workload was meant to evict"
    assert len(engines) == 1
    final = engines[0]
    prompts += [r.output_ids for r in result.requests.values()]
    probes = [p + [7] * (1 + (len(p) + 1) % UNIT) for p in prompts if p]
    probes = [p + [7] * (len(p) % UNIT == 0) for p in probes]

    def hit(tokens: list[int]) -> int:
        probe = 10**6 + len(tokens) + sum(tokens) % 1000
        final.add(probe, tokens)
        tokens_hit = final.lookup(probe).groups[PAGED_GROUP].tokens
        final.finish(probe)
        return int(tokens_hit)

    want = [hit(p) for p in probes]
    deadline = time.time() + 20
    while True:
        got = [indexer.matched(p) for p in probes]
        if got == want or time.time() > deadline:
            break
        time.sleep(0.1)
    assert got == want
    assert any(want), "nothing left cached to compare"
