"""KV events on the wire, in vLLM 0.33's format, for KV-aware routers (NVIDIA Dynamo's KV
router, llm-d's indexer, SGLang's gateway).

A deployment with several engine replicas puts a cache-aware router in front of them; the
router learns which prefixes each replica holds from the replicas' KV events. This module
publishes a :class:`prefixcache.CacheManager`'s block events the way vLLM 0.33's
``ZmqEventPublisher`` does, so a replica built on prefixcache is routable by all of them:

* one ZMQ PUB socket; each batch is one multipart message of 3 frames: the topic (UTF-8), an
  8-byte big-endian sequence number (from 0, +1 per batch) and the msgpack payload
  ``[ts, [events...], data_parallel_rank]`` (the manager encodes it:
  :meth:`CacheManager.drain_events_wire`);
* an optional ROUTER socket that replays buffered batches: a request
  ``[identity, b"", start_seq]`` is answered by one ``[identity, b"", topic, seq, payload]``
  per buffered batch with ``seq >= start_seq``, then the end marker
  ``[identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]``;
* the engine's step never waits on the network: :meth:`ZmqEventPublisher.publish` drains the
  manager and appends the payload to a bounded queue that a background thread sends from. A
  full queue drops the batch and counts it (:attr:`PublisherStats.batches_dropped`); its
  sequence number is consumed, so subscribers see the gap and ask for a replay (which cannot
  hold it either: they know their view is incomplete);
* one publisher per data-parallel rank: the endpoint's port is offset by the rank, as vLLM
  does, and the rank is written into every batch.

Hash values are u64 ids: the low 64 bits of the big-endian digest (:func:`wire_id`), as vLLM
sends them. The wire's block is the hash unit U unless ``CacheConfig.event_block_size`` says a
paged group's block size; a router must use the same block size.

Needs ``pyzmq`` (``pip install 'prefixcache[events]'``).
"""

from __future__ import annotations

import collections
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from prefixcache import CacheManager

__all__ = [
    "END_SEQ",
    "KVEventsConfig",
    "PublisherStats",
    "ZmqEventPublisher",
    "cleared_payload",
    "decode_batch",
    "offset_endpoint_port",
    "wire_id",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay's end marker."""


@dataclass(frozen=True)
class KVEventsConfig:
    """The fields of vLLM 0.33's ``KVEventsConfig``, with its defaults.

    Attributes:
        enable_kv_cache_events: publish at all (``False``: :func:`create_publisher` gives a
            publisher that drains and drops).
        publisher: ``"zmq"`` or ``"null"`` (``None``: ``"zmq"`` when enabled).
        endpoint: the PUB socket's address; it binds when the address contains ``*`` or
            ``::`` or starts with ``ipc://`` / ``inproc://``, and connects otherwise.
        replay_endpoint: the ROUTER socket's address (always bound); ``None``: no replay.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark (ZMQ drops beyond it for a slow subscriber).
        max_queue_size: batches queued for the sender before new ones are dropped (counted).
        topic: the first frame of every message (llm-d expects ``kv@<pod>@<model>``).
    """

    enable_kv_cache_events: bool = True
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            kind = "zmq" if self.enable_kv_cache_events else "null"
            object.__setattr__(self, "publisher", kind)
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher = {self.publisher!r}: use 'zmq' or 'null'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: it must be at least 1")


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank ``data_parallel_rank``, as vLLM derives it: a tcp
    port is offset by the rank (port 0 is left for the OS to choose), an ``inproc`` name gets
    ``_dp<rank>``; rank 0 keeps the endpoint."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            base, _, port = endpoint.rpartition(":")
            if int(port) == 0:
                return endpoint
            return f"{base}:{int(port) + data_parallel_rank}"
        return endpoint
    raise ValueError(f"invalid endpoint {endpoint!r}: it must contain 'inproc' or 'tcp'")


def wire_id(digest: bytes) -> int:
    """The u64 id a digest (``hash_prefix``'s bytes, an event's key) has on the wire: the low
    64 bits of the big-endian digest, as vLLM sends it; when those are 0 (which routers read
    as "no parent") the 64 bits above them, or 1."""
    low = int.from_bytes(digest[-8:], "big")
    if low:
        return low
    return int.from_bytes(digest[-16:-8], "big") or 1


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """Decodes one batch payload into ``(ts, events, data_parallel_rank)``, each event a dict
    (needs ``msgpack``)."""
    import msgpack

    ts, events, rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return ts, events, rank


@dataclass
class PublisherStats:
    """A snapshot of a publisher's health.

    Attributes:
        batches_published: batches sent on the PUB socket.
        events_published: wire events in them.
        batches_dropped: batches dropped because the queue was full (their sequence numbers
            are consumed: subscribers see the gap).
        events_dropped: wire events in them.
        queue_depth: batches waiting for the sender now.
        replays: replay requests served.
        batches_replayed: batches sent in replies.
        core_events_dropped: events the manager dropped because nobody drained them in time
            (``Stats.events_dropped``, for one place to read a publisher's losses).
    """

    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0
    events_dropped: int = 0
    queue_depth: int = 0
    replays: int = 0
    batches_replayed: int = 0
    core_events_dropped: int = 0


@dataclass
class _Counters:
    published: int = 0
    events: int = 0
    dropped: int = 0
    dropped_events: int = 0
    replays: int = 0
    replayed: int = 0
    lock: Any = field(default_factory=threading.RLock)


class ZmqEventPublisher:
    """Publishes a manager's block events on ZMQ in vLLM 0.33's format (module docstring).

    Call :meth:`publish` on the scheduler's thread after each committed step (and after
    ``finish`` and ``reset``): it drains the manager's pending events into one batch and
    queues it, never waiting on the network. :meth:`close` (or ``with``) stops the sender after
    it has sent what is queued.

    Args:
        manager: the manager whose events are published (built with ``enable_events=True``).
        config: the transport settings (default: vLLM's defaults).
        data_parallel_rank: this replica's rank: the endpoint's port is offset by it and
            every batch carries it.
        context: a ``zmq.Context`` to create the sockets in (default: the process's shared
            instance).
        bind: bind the PUB socket (``True``) or connect it (``False``); ``None`` follows
            vLLM's rule (module docstring). ``True`` with ``tcp://127.0.0.1:PORT`` serves
            routers on this machine only.
    """

    def __init__(
        self,
        manager: CacheManager | None,
        config: KVEventsConfig | None = None,
        data_parallel_rank: int = 0,
        context: Any = None,
        bind: bool | None = None,
    ) -> None:
        import zmq

        self.config = config or KVEventsConfig()
        if self.config.publisher != "zmq":
            raise ValueError("ZmqEventPublisher needs publisher='zmq'")
        _check_events_on(manager)
        self.manager = manager
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(self.config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(self.config.replay_endpoint, data_parallel_rank)
        self._topic = self.config.topic.encode("utf-8")
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.config.hwm)
        assert self.endpoint is not None
        if self._binds(self.endpoint) if bind is None else bind:
            self._pub.bind(self.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(self.endpoint)
        self._replay = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
            self._replay.bind(self.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: collections.deque[tuple[int, bytes, int]] = collections.deque()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=self.config.buffer_steps
        )
        self._next_seq = 0
        self._counters = _Counters()
        self._wake = threading.Event()
        self._running = True
        self._thread = threading.Thread(
            target=self._sender, daemon=True, name=f"prefixcache-events-{data_parallel_rank}"
        )
        self._thread.start()

    @staticmethod
    def _binds(endpoint: str) -> bool:
        return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))

    # --- the scheduler's side -------------------------------------------------------------

    def attach(self, manager: CacheManager) -> None:
        """Publishes ``manager``'s events from now on (the previous manager's pending ones are
        published first); a batch holding one ``AllBlocksCleared`` tells subscribers to forget
        what the previous one held."""
        _check_events_on(manager)
        if self.manager is not None:
            self.publish()
        self.manager = manager
        self.publish_payload(cleared_payload(time.time(), self.data_parallel_rank), 1)

    def publish(self) -> int:
        """Drains the manager's pending events into one batch and queues it for sending;
        returns the wire events queued (0 when there was none). Never blocks: when the queue is
        full the batch is dropped and counted."""
        if self.manager is None:
            return 0
        payload, _taken, written = self.manager.drain_events_wire(
            time.time(), self.data_parallel_rank
        )
        if payload is None:
            return 0
        return self.publish_payload(payload, written)

    def publish_payload(self, payload: bytes, events: int = 0) -> int:
        """Queues one already encoded batch payload (of ``events`` wire events); returns
        ``events``, or 0 when the queue was full and the batch was dropped (counted)."""
        if not self._running:
            raise RuntimeError("the publisher is closed")
        seq = self._next_seq
        self._next_seq = seq + 1
        queue = self._queue
        if len(queue) >= self.config.max_queue_size:
            with self._counters.lock:
                self._counters.dropped += 1
                self._counters.dropped_events += events
            return 0
        queue.append((seq, payload, events))
        if len(queue) == 1:
            self._wake.set()
        return events

    def stats(self) -> PublisherStats:
        """A snapshot of the counters."""
        c = self._counters
        with c.lock:
            return PublisherStats(
                batches_published=c.published,
                events_published=c.events,
                batches_dropped=c.dropped,
                events_dropped=c.dropped_events,
                queue_depth=len(self._queue),
                replays=c.replays,
                batches_replayed=c.replayed,
                core_events_dropped=0
                if self.manager is None
                else self.manager.stats().events_dropped,
            )

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued (for up to ``timeout`` seconds), stops the sender and closes
        the sockets."""
        if not self._running:
            return
        self._running = False
        self._wake.set()
        self._thread.join(timeout)
        self._pub.close(linger=int(timeout * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the sender thread ----------------------------------------------------------------

    def _sender(self) -> None:
        queue, wake, c = self._queue, self._wake, self._counters
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            wake.clear()
            if not queue:
                if not self._running:
                    return
                wake.wait(0.01 if self._replay is not None else 0.1)
                continue
            seq, payload, events = queue.popleft()
            seq_bytes = seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            self._buffer.append((seq, payload))
            with c.lock:
                c.published += 1
                c.events += events

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        sent = 0
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
                sent += 1
        # Counted before the end marker goes out, so a client that has read the marker sees
        # its replay in the publisher's statistics.
        with self._counters.lock:
            self._counters.replays += 1
            self._counters.replayed += sent
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _check_events_on(manager: CacheManager | None) -> None:
    if manager is not None and not manager.config.enable_events:
        raise ValueError(
            "the manager records no events: build it with CacheConfig(enable_events=True)"
        )


def cleared_payload(ts: float, data_parallel_rank: int | None = None) -> bytes:
    """The payload of a batch holding one ``AllBlocksCleared`` (as vLLM encodes it)."""
    rank = b"\xc0"
    if data_parallel_rank is not None:
        if not 0 <= data_parallel_rank < 1 << 32:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} out of range")
        if data_parallel_rank < 128:
            rank = bytes([data_parallel_rank])
        elif data_parallel_rank < 256:
            rank = b"\xcc" + bytes([data_parallel_rank])
        elif data_parallel_rank < 1 << 16:
            rank = b"\xcd" + data_parallel_rank.to_bytes(2, "big")
        else:
            rank = b"\xce" + data_parallel_rank.to_bytes(4, "big")
    return b"\x93\xcb" + struct.pack(">d", ts) + b"\x91\x81\xa4type\xb0AllBlocksCleared" + rank


class NullEventPublisher:
    """Drains and drops (vLLM's ``publisher="null"``): the manager's queue stays bounded."""

    def __init__(self, manager: CacheManager) -> None:
        self.manager = manager

    def publish(self) -> int:
        self.manager.drain_events_wire(0.0)
        return 0

    def stats(self) -> PublisherStats:
        return PublisherStats(core_events_dropped=self.manager.stats().events_dropped)

    def close(self, timeout: float = 2.0) -> None:
        return None

    def __enter__(self) -> NullEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create_publisher(
    manager: CacheManager,
    config: KVEventsConfig | None = None,
    data_parallel_rank: int = 0,
) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``config`` names (vLLM's ``EventPublisherFactory.create``)."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher(manager)
    return ZmqEventPublisher(manager, config, data_parallel_rank)


__all__ += ["NullEventPublisher", "create_publisher"]
