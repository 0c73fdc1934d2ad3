"""Prometheus metrics of a :class:`prefixcache.CacheManager` (and of its event publisher).

:class:`PrefixCacheCollector` reads one statistics snapshot (``stats()``, ``pool_usage()``,
the publisher's ``stats()``) per scrape, so the scheduler pays nothing between scrapes. Names
follow vLLM 0.33's meanings under a ``prefixcache:`` prefix, with vLLM's labels
``model_name`` and ``engine``; counters carry ``_total`` on the wire:

* ``prefixcache:prefix_cache_queries`` / ``prefixcache:prefix_cache_hits``: prompt tokens of
  admitted requests, and the tokens of them served from the cache (vLLM's
  ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``);
* ``prefixcache:kv_cache_usage_perc{pool}``: the fraction of a pool's usable blocks that
  running sequences hold (cached, evictable blocks count as free, as in vLLM), per pool;

and what no engine exports: ``prefixcache:group_hit_tokens{group,kind}``,
``prefixcache:misses{group,kind,reason}`` (admissions whose own hit in a group stopped short,
by reason), ``prefixcache:checkpoints_published{group}``,
``prefixcache:checkpoints_skipped{group,reason}``, ``prefixcache:checkpoint_hits{group}``,
``prefixcache:decode_tails_published{group}``, ``prefixcache:evictions{group,kind}``,
``prefixcache:pool_blocks{pool,state}``, ``prefixcache:lookups``,
``prefixcache:events_dropped{where}`` (the manager's undrained queue, the publisher's full
queue) and the publisher's health: ``prefixcache:event_batches_published``,
``prefixcache:events_published``, ``prefixcache:event_batches_dropped``,
``prefixcache:event_queue_depth``, ``prefixcache:event_replays``.

Needs ``prometheus_client`` (``pip install 'prefixcache[metrics]'``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixcache import CacheManager

__all__ = ["PrefixCacheCollector", "group_kind", "serve"]


def group_kind(group: object) -> str:
    """The ``kind`` label of a configured group: ``full_attention``, ``sliding_window`` or
    ``state``."""
    name = type(group).__name__
    return {"FullAttention": "full_attention", "SlidingWindow": "sliding_window"}.get(name, "state")


class PrefixCacheCollector:
    """A ``prometheus_client`` collector over one manager (and optionally its publisher).

    Args:
        manager: the manager to read, or a function returning the manager to read now (one
            that follows runs; ``None`` then serves no manager metrics).
        publisher: a :class:`prefixcache.events.ZmqEventPublisher` (anything with a
            ``stats()`` returning :class:`prefixcache.events.PublisherStats`), or ``None``.
        model_name: the ``model_name`` label.
        engine: the ``engine`` label (vLLM: the engine index).
    """

    def __init__(
        self,
        manager: CacheManager | Callable[[], CacheManager | None],
        publisher: Any = None,
        model_name: str = "",
        engine: str = "0",
    ) -> None:
        self.manager = manager
        self.publisher = publisher
        self.labels = {"model_name": model_name, "engine": engine}

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        manager = self.manager() if callable(self.manager) else self.manager
        if manager is None:
            return
        kinds = [group_kind(g) for g in manager.config.groups]
        base = list(self.labels)
        values = list(self.labels.values())
        stats = manager.stats()
        usage = manager.pool_usage()

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return CounterMetricFamily(f"prefixcache:{name}", doc, labels=[*base, *extra])

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return GaugeMetricFamily(f"prefixcache:{name}", doc, labels=[*base, *extra])

        m = counter("prefix_cache_queries", "Prompt tokens of admitted requests (queries).")
        m.add_metric(values, stats.admitted_tokens)
        yield m
        m = counter("prefix_cache_hits", "Prompt tokens of admitted requests served from cache.")
        m.add_metric(values, stats.admitted_hit_tokens)
        yield m
        m = counter("lookups", "Lookups made.")
        m.add_metric(values, stats.lookups)
        yield m
        m = counter("admissions", "Requests admitted (first schedules).")
        m.add_metric(values, stats.admissions)
        yield m

        m = gauge(
            "kv_cache_usage_perc",
            "Fraction of a pool's usable blocks held by running sequences (0..1).",
            ("pool",),
        )
        blocks = gauge("pool_blocks", "Blocks of a pool by state.", ("pool", "state"))
        for p, u in enumerate(usage):
            usable = max(u.num_blocks - 1, 1)
            m.add_metric([*values, str(p)], u.owned / usable)
            for state in ("free", "cached", "owned"):
                blocks.add_metric([*values, str(p), state], getattr(u, state))
        yield m
        yield blocks

        groups = list(enumerate(stats.groups))
        hits = counter(
            "group_hit_tokens", "Hit tokens admissions used, per group.", ("group", "kind")
        )
        evictions = counter("evictions", "Blocks evicted for reuse, per group.", ("group", "kind"))
        misses = counter(
            "misses",
            "Admissions whose own hit in a group stopped short of the prompt, by reason.",
            ("group", "kind", "reason"),
        )
        published = counter(
            "checkpoints_published", "State checkpoints published, per group.", ("group",)
        )
        skipped = counter(
            "checkpoints_skipped",
            "Retained checkpoint positions not exported, by reason.",
            ("group", "reason"),
        )
        ckpt_hits = counter(
            "checkpoint_hits", "Admissions that resumed from a published checkpoint.", ("group",)
        )
        tails = counter(
            "decode_tails_published", "Decode-tail checkpoints published by finish.", ("group",)
        )
        for g, gs in groups:
            label = [*values, str(g), kinds[g]]
            hits.add_metric(label, gs.hit_tokens)
            evictions.add_metric(label, gs.evictions)
            for reason, n in gs.misses.items():
                misses.add_metric([*label, reason], n)
            if kinds[g] == "state":
                published.add_metric([*values, str(g)], gs.checkpoints_published)
                ckpt_hits.add_metric([*values, str(g)], gs.checkpoint_hits)
                tails.add_metric([*values, str(g)], gs.decode_tails_published)
                for reason, n in gs.checkpoints_skipped.items():
                    skipped.add_metric([*values, str(g), reason], n)
        yield from (hits, evictions, misses, published, skipped, ckpt_hits, tails)

        dropped = counter("events_dropped", "Events dropped, by where.", ("where",))
        dropped.add_metric([*values, "manager"], stats.events_dropped)
        if self.publisher is not None:
            p = self.publisher.stats()
            dropped.add_metric([*values, "queue"], p.events_dropped)
            yield dropped
            for make, name, doc, value in (
                (
                    counter,
                    "event_batches_published",
                    "Event batches sent on the PUB socket.",
                    p.batches_published,
                ),
                (
                    counter,
                    "events_published",
                    "Wire events sent on the PUB socket.",
                    p.events_published,
                ),
                (
                    counter,
                    "event_batches_dropped",
                    "Event batches dropped on a full queue.",
                    p.batches_dropped,
                ),
                (
                    gauge,
                    "event_queue_depth",
                    "Event batches waiting for the sender.",
                    p.queue_depth,
                ),
                (counter, "event_replays", "Replay requests served.", p.replays),
            ):
                m = make(name, doc)
                m.add_metric(values, value)
                yield m
        else:
            yield dropped


def serve(
    manager: CacheManager | Callable[[], CacheManager | None],
    port: int,
    *,
    publisher: Any = None,
    addr: str = "127.0.0.1",
    model_name: str = "",
    engine: str = "0",
) -> tuple[Any, Any]:
    """Serves the manager's metrics over HTTP at ``http://addr:port/metrics`` (a daemon thread,
    its own registry). Returns ``(server, thread)``; ``server.shutdown()`` stops it. Port 0
    picks a free port: ``server.server_port`` is the one bound."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PrefixCacheCollector(manager, publisher, model_name, engine))
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return server, thread
