"""The peer comparison's plumbing (benchmarks/peers.py, vs_vllm.py's pair running, SGLang's
hit rule), without any peer installed: the merge of drivers' documents, the entry contract, one
real pair run on a tiny workload with prefixcache standing in as the peer, and the reasons a
hit difference with SGLang is given."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import peers
import vs_vllm
from vs_vllm_backends import ManagerConfig, PrefixcacheBackend
from vs_vllm_workloads import GrowingPrefix


def entry(median: float, target: float, judged: bool = True) -> dict[str, Any]:
    return {
        "ratio_min": median / 2,
        "ratio_median": median,
        "ratio_max": median * 2,
        "ratios": [median / 2, median, median * 2],
        "peer_seconds": median,
        "prefixcache_seconds": 1.0,
        "target_ratio": target,
        "meets_target": median >= target,
        "target_judged_here": judged,
    }


def test_merge_replaces_measured_peers_and_keeps_the_others() -> None:
    first = peers.merge(
        None,
        {"vllm-0.33": {"w": {"c": entry(60, 50)}}, "kvbm-x": {"w": {"c": entry(6, 5)}}},
        {"date": "d1"},
    )
    again = peers.merge(first, {"vllm-0.33": {"w": {"c": entry(70, 50)}}}, {"date": "d2"})
    assert again["peers"]["vllm-0.33"]["w"]["c"]["ratio_median"] == 70
    assert again["peers"]["kvbm-x"] == first["peers"]["kvbm-x"]
    # Each kept peer is still attributed to the run that measured it, and only to it.
    runs = {run["date"]: run["peers"] for run in again["meta"]["runs"]}
    assert runs == {"d1": ["kvbm-x"], "d2": ["vllm-0.33"]}
    # A run whose peers were all measured again disappears.
    last = peers.merge(again, {"kvbm-x": {"w": {"c": entry(7, 5)}}}, {"date": "d3"})
    assert sorted(run["date"] for run in last["meta"]["runs"]) == ["d2", "d3"]


def test_check_document_names_each_broken_rule() -> None:
    good = {"sglang-0.5.23-rust-p1": {"w": {"c": entry(6, 5)}}}
    assert peers.check_document(good) == []
    unnamed = {"somebody": {"w": {"c": entry(6, 5)}}}
    assert any("name" in p for p in peers.check_document(unnamed))
    missing = copy.deepcopy(good)
    del missing["sglang-0.5.23-rust-p1"]["w"]["c"]["target_ratio"]
    assert any("target_ratio" in p for p in peers.check_document(missing))
    wrong = copy.deepcopy(good)
    wrong["sglang-0.5.23-rust-p1"]["w"]["c"]["meets_target"] = False
    assert any("meets_target" in p for p in peers.check_document(wrong))
    disordered = copy.deepcopy(good)
    disordered["sglang-0.5.23-rust-p1"]["w"]["c"]["ratio_min"] = 100.0
    assert any("order" in p for p in peers.check_document(disordered))


def test_markdown_table_lists_the_judged_entries_only() -> None:
    document = peers.merge(
        None,
        {"vllm-0.33": {"w": {"c": entry(40, 50, judged=False), "c+extends": entry(60, 50)}}},
        {"date": "d"},
    )
    table = peers.markdown_table(document)
    assert "c+extends" in table and "| c |" not in table
    assert "50x met" in table


@pytest.mark.parametrize("workload_scale", [0.01])
def test_run_config_writes_entries_of_the_contract(workload_scale: float) -> None:
    """A real pair run (prefixcache standing in as the peer, with an independent backend of
    its own) gives entries the merge accepts: ratios of the two runs' seconds, judged once."""
    workload = GrowingPrefix(workload_scale)
    config = ManagerConfig("attention-b16-xxh3", "attention", 16, 16, "xxh3_128")
    entries = vs_vllm.run_config(
        workload,
        config,
        1,
        lambda: PrefixcacheBackend(config, workload),
        {"scale": workload_scale},
        peer="peer",
        target=5.0,
    )
    assert set(entries) == {"attention-b16-xxh3", "attention-b16-xxh3+extends"}
    assert peers.check_document({"vllm-standin": {"growing-prefix": entries}}) == []
    assert [name for name, e in entries.items() if e["target_judged_here"]] == [
        "attention-b16-xxh3+extends"
    ]
    plain = entries["attention-b16-xxh3"]
    assert plain["ratios"] == [plain["peer_runs_seconds"][0] / plain["prefixcache_runs_seconds"][0]]
    # The same manager on both sides hits the same tokens for every request.
    assert plain["hits"]["differing_requests"] == 0
    assert plain["hits"]["peer_hit_tokens"] == plain["hits"]["prefixcache_hit_tokens"] > 0
    assert plain["hashing_floor_seconds"] > 0


def test_sglang_hit_rule_names_each_reason_and_refuses_the_rest() -> None:
    """SGLang's classification, stated independently: with both sides having seen C committed
    tokens of a request's shared prefix (limit L = min(prefix, prompt - 1)), a page-1 token tree
    hits min(L, C) exactly and prefixcache floor(min(L, C), 16); at page 16 both floor to 16 but
    from their own covers; anything else is unexplained. Hybrid: SGLang at a recorded state,
    prefixcache at the earlier prompt's tail checkpoint ((C - 1) // 128) * 128."""
    import numpy as np
    import peers_sglang
    from peers_sglang_backend import SglangConfig
    from vs_vllm_workloads import Request

    prompt = np.arange(4096, dtype=np.uint32)
    request = Request(7, prompt, prompt[:2], None, prefix_key=0, prefix_len=2048)

    def runs(peer_hit: int, our_hit: int, peer_cover: int, our_cover: int) -> tuple:
        peer = vs_vllm.RunResult(0.0, {}, {}, 1, {7: peer_hit}, {7: (peer_cover, peer_cover)})
        ours = vs_vllm.RunResult(0.0, {}, {}, 1, {7: our_hit}, {7: (our_cover, our_cover)})
        return peer, ours

    attention = peers_sglang.ATTENTION
    workload = GrowingPrefix(0.01)
    page1 = peers_sglang.hit_rule(SglangConfig("rust", 1), [], workload)
    assert page1(request, attention, *runs(1975, 1968, 1975, 1975)) == "token_tree"
    assert page1(request, attention, *runs(1975, 1960, 1975, 1975)) is None
    assert page1(request, attention, *runs(1976, 1968, 1975, 1975)) is None
    page16 = peers_sglang.hit_rule(SglangConfig("rust", 16), [], workload)
    assert page16(request, attention, *runs(1520, 1536, 1533, 1540)) == "page_rounding"
    assert page16(request, attention, *runs(1533, 1536, 1533, 1540)) is None

    backend = SimpleNamespace(hit_at_state={7: True})
    hybrid = peers_sglang.HYBRID
    mamba = peers_sglang.hit_rule(SglangConfig("rust", 1, mamba=True), [backend], workload)
    assert mamba(request, hybrid, *runs(2000, 1920, 2000, 2000)) == "mamba_states"
    assert mamba(request, hybrid, *runs(2000, 2048, 2000, 2000)) is None
    backend.hit_at_state[7] = False
    assert mamba(request, hybrid, *runs(2000, 1920, 2000, 2000)) is None
