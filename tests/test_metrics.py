"""Prometheus metrics: scraped over HTTP on loopback, the values are the manager's statistics
(one snapshot per scrape), under vLLM's meanings with a ``prefixcache:`` prefix."""

from __future__ import annotations

import urllib.request
from typing import Any

import prefixcache as pc
import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prefixcache import metrics  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(
                sorted(
                    (k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")
                )
            )
            out[(sample.name, labels)] = sample.value
    return out


def manager() -> pc.CacheManager:
    return pc.CacheManager(
        pc.CacheConfig(
            pools=[pc.PoolConfig(13), pc.PoolConfig(16)],
            groups=[pc.FullAttention(4, pool=0), pc.StateGroup(alignment=4, pool=1)],
            hash=pc.HashConfig(unit=4),
        )
    )


def step(mgr: pc.CacheManager, seq: int, tokens: list[int]) -> None:
    mgr.add(seq, tokens)
    assert mgr.schedule(seq, len(tokens)) is not None
    mgr.commit(mgr.build_plan())


def test_scraped_values_are_the_statistics() -> None:
    mgr = manager()
    server, _ = metrics.serve(mgr, 0, model_name="m")
    try:
        port = server.server_port
        step(mgr, 1, list(range(13)))
        mgr.finish(1)
        step(mgr, 2, [*list(range(13)), 99, 98, 97])  # hits the first request's prefix
        mgr.finish(2)
        step(mgr, 3, list(range(300, 340)))  # more than the pool keeps: evictions
        got = scrape(port)
        stats, usage = mgr.stats(), mgr.pool_usage()
        assert got[("prefixcache:prefix_cache_queries_total", ())] == stats.admitted_tokens
        assert stats.admitted_tokens == 13 + 16 + 40
        assert got[("prefixcache:prefix_cache_hits_total", ())] == stats.admitted_hit_tokens > 0
        assert got[("prefixcache:lookups_total", ())] == stats.lookups
        for p, u in enumerate(usage):
            value = got[("prefixcache:kv_cache_usage_perc", (("pool", str(p)),))]
            assert value == pytest.approx(u.owned / (u.num_blocks - 1))
            for state in ("free", "cached", "owned"):
                key = ("prefixcache:pool_blocks", (("pool", str(p)), ("state", state)))
                assert got[key] == getattr(u, state)
        for g, gs in enumerate(stats.groups):
            kind = "full_attention" if g == 0 else "state"
            labels = (("group", str(g)), ("kind", kind))
            assert got[("prefixcache:group_hit_tokens_total", labels)] == gs.hit_tokens
            assert got[("prefixcache:evictions_total", labels)] == gs.evictions
            for reason, n in gs.misses.items():
                key = ("prefixcache:misses_total", (*labels, ("reason", reason)))
                assert got[key] == n
        assert sum(gs.evictions for gs in stats.groups) == stats.evictions > 0
        state = stats.groups[1]
        assert got[("prefixcache:checkpoints_published_total", (("group", "1"),))] == (
            state.checkpoints_published
        )
        assert got[("prefixcache:checkpoint_hits_total", (("group", "1"),))] == (
            state.checkpoint_hits
        )
        for reason, n in state.checkpoints_skipped.items():
            key = ("prefixcache:checkpoints_skipped_total", (("group", "1"), ("reason", reason)))
            assert got[key] == n
        assert got[("prefixcache:events_dropped_total", (("where", "manager"),))] == 0
        # One snapshot per scrape: the next scrape sees the next step.
        mgr.finish(3)
        step(mgr, 4, list(range(13)))
        again = scrape(port)
        assert again[("prefixcache:prefix_cache_queries_total", ())] == stats.admitted_tokens + 13
    finally:
        server.shutdown()


def test_publisher_health_is_exported(tmp_path: Any) -> None:
    pytest.importorskip("zmq")
    from prefixcache import events

    mgr = manager()
    config = events.KVEventsConfig(endpoint=f"ipc://{tmp_path}/pub")
    with events.ZmqEventPublisher(mgr, config) as pub:
        step(mgr, 1, list(range(9)))
        assert pub.publish() > 0
        collector = metrics.PrefixCacheCollector(lambda: mgr, pub)
        registry = prometheus_client.CollectorRegistry(auto_describe=False)
        registry.register(collector)
        text = prometheus_client.generate_latest(registry).decode()
        names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        for name in (
            "event_batches_published",
            "events_published",
            "event_batches_dropped",
            "event_replays",
        ):
            assert f"prefixcache:{name}_total" in names
        assert "prefixcache:event_queue_depth" in names
