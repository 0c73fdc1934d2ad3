"""Plan arrays are made once, on first read: no copy per read, shared with torch; large ones
are the core's own vectors, moved into NumPy without a copy."""

from __future__ import annotations

import gc

import numpy as np
import prefixcache as pc
import pytest
import torch
from conftest import hybrid_config


@pytest.fixture
def plan() -> pc.StepPlan:
    mgr = pc.CacheManager(hybrid_config(max_checkpoints_per_step=2))
    for seq in range(3):
        mgr.add(seq, list(range(seq, seq + 100)))
    mgr.schedule_batch([0, 1, 2], 1000)
    return mgr.build_plan()


def every_array(plan: pc.StepPlan) -> dict[str, np.ndarray]:
    arrays = {
        "seq_ids": plan.seq_ids,
        "query_start_loc": plan.query_start_loc,
        "num_computed": plan.num_computed,
        "num_scheduled": plan.num_scheduled,
        "copies": plan.copies,
    }
    for p in plan.paged:
        arrays |= {
            f"paged{p.group}.appended": p.appended,
            f"paged{p.group}.replaced": p.replaced,
            f"paged{p.group}.slot_mapping": p.slot_mapping,
        }
    for s in plan.state:
        arrays |= {
            f"state{s.group}.running_slot": s.running_slot,
            f"state{s.group}.initial_slot": s.initial_slot,
            f"state{s.group}.checkpoint_offsets": s.checkpoint_offsets,
            f"state{s.group}.checkpoint_slots": s.checkpoint_slots,
            f"state{s.group}.snapshots": s.snapshots,
        }
    return arrays


def test_two_reads_return_the_same_buffer(plan: pc.StepPlan) -> None:
    first = every_array(plan)
    again = every_array(plan)
    for name, array in first.items():
        assert array is again[name], name
    # One buffer, not a copy per read: a value written through the first read is what a later
    # read of the attribute sees (a fresh copy per read would still hold the old value).
    plan.query_start_loc[1] = 12345
    assert plan.query_start_loc[1] == 12345
    for array in first.values():
        if array.size:
            array.flat[0] = -7
    for name, array in every_array(plan).items():
        if array.size:
            assert array.flat[0] == -7, name
    assert plan.paged[0] is plan.paged_group(0)
    assert plan.state[0].running_slot is plan.state_group(1).running_slot


def test_small_arrays_are_copied_once_large_ones_are_moved() -> None:
    mgr = pc.CacheManager(hybrid_config(num_blocks=512, max_checkpoints_per_step=2))
    mgr.add(1, list(range(3000)))
    mgr.add(2, list(range(20)))
    mgr.schedule_batch([1, 2], 3000)
    plan = mgr.build_plan()
    for name, array in every_array(plan).items():
        assert array.flags.c_contiguous and array.flags.writeable, name
        if name.endswith("slot_mapping"):
            # 3,020 int64 slots (24 KB): the core's vector itself, kept alive by the base.
            assert not array.flags.owndata and array.base is not None, name
        else:
            # A few bytes: copied into an array that owns its memory, at the first read.
            assert array.flags.owndata and array.nbytes <= 4096, name
    assert plan.paged[0].slot_mapping.shape == (3020,)


def test_sizes_and_reprs_agree_with_the_arrays_read_later() -> None:
    mgr = pc.CacheManager(hybrid_config())
    mgr.add(1, list(range(50)))
    mgr.schedule(1, 50)
    plan = mgr.build_plan()
    first = plan.state[0].running_slot
    assert first.tolist() == plan.state[0].running_slot.tolist()
    assert repr(plan).startswith(f"StepPlan(step_id={plan.step_id}, rows=1, tokens=50")
    assert "rows=1" in repr(plan.state[0]) and "tokens=50" in repr(plan.paged[0])
    assert plan.state[0].running_slot is first
    mgr.commit(plan)


def test_torch_from_numpy_shares_the_plan_memory(plan: pc.StepPlan) -> None:
    qsl = torch.from_numpy(plan.query_start_loc)
    assert qsl.dtype == torch.int32 and qsl.tolist() == plan.query_start_loc.tolist()
    assert qsl.data_ptr() == plan.query_start_loc.__array_interface__["data"][0]
    slots = torch.from_numpy(plan.paged[0].slot_mapping)
    assert slots.dtype == torch.int64 and slots.shape == (300,)
    offsets = torch.from_numpy(plan.state[0].checkpoint_offsets)
    assert offsets.shape == plan.state[0].checkpoint_offsets.shape
    # Writes through torch are visible through NumPy: one buffer.
    qsl[0] = 5
    assert plan.query_start_loc[0] == 5


def test_arrays_outlive_the_plan_and_the_manager() -> None:
    mgr = pc.CacheManager(hybrid_config())
    mgr.add(1, list(range(50)))
    mgr.schedule(1, 50)
    plan = mgr.build_plan()
    slots = plan.paged[0].slot_mapping
    tensor = torch.from_numpy(plan.state[0].running_slot)
    expected = slots.tolist()
    running = plan.state[0].running_slot.tolist()
    assert len(expected) == 50 and len(running) == 1 and running[0] > 0
    mgr.commit(plan)
    del plan, mgr
    gc.collect()
    assert slots.tolist() == expected
    assert tensor.tolist() == running
