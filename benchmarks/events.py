"""The cost of publishing KV events, on the scheduler's thread, and the sender's throughput.

1. A decode step of 256 sequences (U = B = 16, 4,096-token prompts, one token each per step:
   a sequence crosses a unit boundary every 16 steps, so 16 stored runs per step on average),
   each step one ``decode_step`` call: events off; events on and drained to wire bytes
   (``drain_events_wire``); events on and published (``ZmqEventPublisher.publish``, a PUB socket
   on ipc with a subscriber reading in another process). Medians of the per-step time, in
   microseconds, and the overhead over events off.
2. The sender's sustained rate: batches of real stored runs queued while the sender is stalled,
   then the time until all are sent to a subscriber (events per second).

Run: ``OPENBLAS_NUM_THREADS=1 python benchmarks/events.py [--steps N]``.

For instruction counts, ``--only MODE`` (``off`` or ``drain``) runs only that mode's decode
steps and prints nothing: under ``valgrind --tool=callgrind``, the instructions of
``--steps 400`` minus those of ``--steps 100``, over 300, are one step's, a figure machine load
does not move.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time

import numpy as np
import prefixcache as pc
import zmq
from prefixcache import events as ev

ROWS = 256
PROMPT = 4096


def manager(events: bool, steps: int = 0) -> tuple[pc.CacheManager, np.ndarray, pc.PlanBuffers]:
    blocks = ROWS * ((PROMPT + steps + 32) // 16 + 2) + 16
    mgr = pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(blocks)],
            groups=[pc.FullAttention(16)],
            hash=pc.HashConfig(unit=16),
            enable_events=events,
        )
    )
    rng = np.random.default_rng(0)
    ids = np.arange(ROWS, dtype=np.uint64)
    for seq in ids.tolist():
        mgr.add(seq, rng.integers(0, 150_000, PROMPT, dtype=np.uint32))
        assert mgr.schedule(seq, PROMPT) is not None
        mgr.commit(mgr.build_plan())
    mgr.drain_events()
    # Stagger the sequences so that boundaries are spread over the steps.
    for seq in ids.tolist():
        extra = seq % 16
        if extra:
            mgr.append(seq, list(range(extra)))
            assert mgr.schedule(seq, extra) is not None
            mgr.commit(mgr.build_plan())
    mgr.drain_events()
    buffers = pc.PlanBuffers(rows=ROWS)
    return mgr, ids, buffers


def read(endpoint: str) -> None:
    """A subscriber reading every batch (run in its own process)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while True:
        sub.recv_multipart()


def decode(mode: str, steps: int, tmp: str) -> list[float]:
    mgr, ids, buffers = manager(mode != "off", steps)
    pub = reader = None
    if mode == "publish":
        pub = ev.ZmqEventPublisher(mgr, ev.KVEventsConfig(endpoint=f"ipc://{tmp}/decode"))
        # The subscriber is another process, as a router is: it takes no GIL from this one.
        reader = multiprocessing.get_context("spawn").Process(
            target=read, args=(f"ipc://{tmp}/decode",), daemon=True
        )
        reader.start()
    times = []
    for step in range(steps):
        sampled = ((ids + step) % 150_000).astype(np.uint32)
        t0 = time.perf_counter_ns()
        scheduled = mgr.decode_step(buffers, ids, sampled)
        if mode == "drain":
            mgr.drain_events_wire(1.0, 0)
        elif pub is not None:
            pub.publish()
        times.append((time.perf_counter_ns() - t0) / 1e3)
        assert int(scheduled.sum()) == ROWS
    if pub is not None:
        pub.close()
        assert reader is not None
        reader.terminate()
        reader.join()
    return times[steps // 10 :]


def sender_rate(batches: int, tmp: str) -> tuple[float, int]:
    mgr, _, _ = manager(True)
    for seq in range(ROWS):
        mgr.finish(seq)
    # Real payloads: 16 stored runs of one unit each per batch.
    payloads = []
    for b in range(batches // 16 + 1):
        for i in range(16):
            sid = 10_000 + b * 16 + i
            mgr.add(sid, list(range(sid * 17, sid * 17 + 17)))
            assert mgr.schedule(sid, 17) is not None
            mgr.commit(mgr.build_plan())
            mgr.finish(sid)
        payload, _, written = mgr.drain_events_wire(1.0, 0)
        assert payload is not None
        payloads.append((payload, written))
    ctx = zmq.Context.instance()
    pub = ev.ZmqEventPublisher(
        mgr, ev.KVEventsConfig(endpoint=f"ipc://{tmp}/rate", max_queue_size=batches + 1)
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(f"ipc://{tmp}/rate")
    while not sub.poll(10):
        pub.publish_payload(ev.cleared_payload(0.0), 1)
    while sub.poll(100):
        sub.recv_multipart()
    base = pub.stats().batches_published
    received = 0
    with pub._counters.lock:  # stall the sender while the queue fills
        events = 0
        for i in range(batches):
            payload, written = payloads[i % len(payloads)]
            pub.publish_payload(payload, written)
            events += written
        t0 = time.perf_counter()
    while received < batches:
        sub.recv_multipart()
        received += 1
    seconds = time.perf_counter() - t0
    assert pub.stats().batches_published - base == batches
    pub.close()
    sub.close(0)
    return events / seconds, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--only", choices=("off", "drain"), help="run only this mode's steps")
    args = parser.parse_args()
    if args.only is not None:
        with tempfile.TemporaryDirectory() as tmp:
            decode(args.only, args.steps, tmp)
        return
    with tempfile.TemporaryDirectory() as tmp:
        medians = {}
        for mode in ("off", "drain", "publish", "off", "drain", "publish"):
            times = decode(mode, args.steps, tmp)
            medians.setdefault(mode, []).append(statistics.median(times))
        off = min(medians["off"])
        print(f"decode step of {ROWS} sequences, median us (two alternated runs each):")
        for mode, values in medians.items():
            best = min(values)
            print(
                f"  {mode:8s} {' / '.join(f'{v:.1f}' for v in values)}"
                f"  (+{best - off:.2f} us, {100 * (best - off) / off:+.1f}%)"
            )
        rate, events = sender_rate(args.batches, tmp)
        print(f"sender: {events} events in {args.batches} batches, {rate / 1e6:.2f} M events/s")


if __name__ == "__main__":
    main()
