"""`prefixcache.kernels.BlockTables`: incremental block tables that can take a step back.

Two references: a plain-list model of the same operations (random append / replace / abort /
release sequences, from tiny capacities so that both axes grow), and the core itself (a
manager with a full-attention and a sliding-window group, whose plans' `appended` and
`replaced` entries are applied step by step and compared with `manager.block_table`).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefixcache.kernels import BlockTables

# One operation: ("apply", rows, appends per row, replacements), ("rollback", count),
# ("release", i).
ROW = st.integers(min_value=0, max_value=7)  # which sequence id a plan row is
APPLY = st.tuples(
    st.just("apply"),
    st.lists(ROW, min_size=1, max_size=4, unique=True),
    st.lists(st.integers(min_value=0, max_value=5), min_size=4, max_size=4),  # appends per row
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 99)), max_size=4),
)
OPERATION = st.one_of(
    APPLY,
    APPLY,
    st.tuples(st.just("rollback"), st.integers(min_value=1, max_value=3)),
    st.tuples(st.just("release"), ROW),
)


class ListTables:
    """The plain-list statement of what BlockTables does, keeping the latest ``depth`` steps.

    A step is remembered as the whole set of tables before it and the sequences it named.
    Rolling back n steps restores the tables from before the oldest of them. A release is never
    undone: a released column is blanked in the remembered tables too, and a released sequence
    leaves them, together with the steps that named it and every step before those.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.tables: dict[int, list[int]] = {}
        self.steps: list[tuple[dict[int, list[int]], set[int]]] = []  # (tables before, named)

    def apply(
        self,
        seq_ids: list[int],
        appended: list[tuple[int, int, int]],
        replaced: list[tuple[int, int, int]],
    ) -> None:
        before = {seq: list(table) for seq, table in self.tables.items()}
        for seq in seq_ids:
            self.tables.setdefault(seq, [])
        for row, column, block in appended:
            table = self.tables[seq_ids[row]]
            if column >= len(table):
                table.extend([0] * (column + 1 - len(table)))
            table[column] = block
        self.steps.append((before, set(seq_ids)))
        self.steps = self.steps[-self.depth :]
        for row, column, block in replaced:
            seq = seq_ids[row]
            self.tables[seq][column] = block
            for remembered, _ in self.steps:
                if seq in remembered and column < len(remembered[seq]):
                    remembered[seq][column] = block

    def can_roll_back(self, count: int) -> bool:
        return count <= len(self.steps)

    def rollback(self, count: int) -> None:
        """The appended entries of the latest ``count`` steps are taken back."""
        self.tables = self.steps[-count][0]
        self.steps = self.steps[:-count]

    def release(self, seq: int) -> None:
        named = [i for i, (_, seqs) in enumerate(self.steps) if seq in seqs]
        if seq in self.tables and named:
            self.steps = self.steps[named[-1] + 1 :]
        for remembered, _ in self.steps:
            remembered.pop(seq, None)
        self.tables.pop(seq, None)


def assert_same(tables: BlockTables, model: ListTables) -> None:
    assert len(tables) == len(model.tables)
    assert tables.undoable == len(model.steps)
    for seq, table in model.tables.items():
        assert seq in tables
        assert tables.row(seq) == table
        assert tables.length(seq) == len(table)
    ids = sorted(model.tables)
    gathered = tables.gather(ids)
    width = max((len(model.tables[s]) for s in ids), default=0)
    assert gathered.dtype == np.int32 and gathered.shape == (len(ids), width)
    for row, seq in enumerate(ids):
        table = model.tables[seq]
        assert gathered[row].tolist() == table + [0] * (width - len(table))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=1, max_value=3), st.lists(OPERATION, max_size=30))
def test_block_tables_do_what_plain_lists_do(depth: int, operations: list[tuple]) -> None:
    tables = BlockTables(rows=1, width=1, depth=depth)
    model = ListTables(depth)
    for operation in operations:
        if operation[0] == "apply":
            _, seq_ids, appends, releases = operation
            appended = []
            for row, seq in enumerate(seq_ids):
                start = len(model.tables.get(seq, []))
                appended += [(row, start + k, 100 + seq * 10 + k) for k in range(appends[row])]
            lengths = [len(model.tables.get(seq, [])) + appends[r] for r, seq in enumerate(seq_ids)]
            # Releases (block 0) of columns the rows have once this step's appends are in.
            replaced = [
                (r, c % lengths[r], 0) for r, c, _ in releases if r < len(seq_ids) and lengths[r]
            ]
            model.apply(seq_ids, appended, replaced)
            tables.apply(
                np.asarray(seq_ids, dtype=np.int64),
                np.asarray(appended, dtype=np.int32).reshape(-1, 3),
                np.asarray(replaced, dtype=np.int32).reshape(-1, 3),
            )
        elif operation[0] == "rollback":
            count = operation[1]
            if model.can_roll_back(count):
                model.rollback(count)
                tables.rollback(count)
            else:
                with pytest.raises(RuntimeError, match="no applied step"):
                    tables.rollback(count)
        else:
            model.release(operation[1])
            tables.release(operation[1])
        assert_same(tables, model)


def test_two_plans_in_flight_roll_back_together_and_a_finish_keeps_the_newer_undoable() -> None:
    # Depth 2, as an engine with two plans in flight: sequence 1 is in step A only and
    # finishes while step B (sequences 2 and 3) is in flight; B can still be taken back.
    tables = BlockTables(rows=2, width=2, depth=2)
    none = np.zeros((0, 3), dtype=np.int32)
    tables.apply([1, 2], [[0, 0, 11], [1, 0, 21]], none)  # A
    tables.apply([2, 3], [[0, 1, 22], [1, 0, 31]], none)  # B
    tables.release(1)
    assert tables.undoable == 1
    tables.rollback()
    assert (tables.row(2), 3 in tables, 1 in tables) == ([21], False, False)
    with pytest.raises(RuntimeError, match="no applied step"):
        tables.rollback()  # A was forgotten with the release of sequence 1
    # A release of a sequence in the newest step forgets both.
    tables.apply([2], [[0, 1, 23]], none)
    tables.apply([2, 4], [[0, 2, 24], [1, 0, 41]], none)
    tables.rollback(2)
    assert (tables.row(2), 4 in tables) == ([21], False)
    tables.apply([2], [[0, 1, 25]], none)
    tables.apply([2], [[0, 2, 26]], none)
    tables.release(2)
    assert tables.undoable == 0 and len(tables) == 0


@pytest.mark.parametrize(
    ("appended", "replaced", "message"),
    [
        ([[2, 1, 9]], [], "appended entries name rows outside"),
        ([[0, 1, 9]], [[1, -1, 0]], "replaced entries name rows outside"),
        ([[0, 1, 9]], [[1, 0, 0]], "a column its row does not have"),
    ],
)
def test_a_bad_entry_is_refused_and_changes_nothing(
    appended: list[list[int]], replaced: list[list[int]], message: str
) -> None:
    tables = BlockTables()
    tables.apply([5], [[0, 0, 7]], np.zeros((0, 3), dtype=np.int32))
    with pytest.raises(ValueError, match=message):
        tables.apply([5, 6], appended, np.asarray(replaced, dtype=np.int32).reshape(-1, 3))
    assert len(tables) == 1 and tables.row(5) == [7] and 6 not in tables
    tables.rollback()  # the refused apply left the previous step's undo in place
    assert len(tables) == 0


def test_a_long_context_decode_step_touches_only_its_entries() -> None:
    # 4 sequences of 10,000 blocks each: one decode step appends one block to one of them.
    # The apply writes one cell; the gather copies the [4, 10001] table in NumPy.
    tables = BlockTables(rows=4, width=8)
    ids = np.arange(4, dtype=np.int64)
    prefill = np.array([(r, c, 1 + c) for r in range(4) for c in range(10_000)], dtype=np.int32)
    tables.apply(ids, prefill, np.zeros((0, 3), dtype=np.int32))
    tables.apply(ids, np.array([[2, 10_000, 5]], dtype=np.int32), np.zeros((0, 3), np.int32))
    gathered = tables.gather(ids)
    assert gathered.shape == (4, 10_001)
    assert gathered[2, -1] == 5 and gathered[0, -1] == 0 and gathered[3, 9_999] == 10_000
    tables.rollback()
    assert tables.gather(ids).shape == (4, 10_000)


def assert_same_as_core(manager: object, tables: list[BlockTables], ids: list[int]) -> None:
    for table in tables:
        known = [seq for seq in ids if seq in table]
        if known:
            expected = manager.block_table(table.group, known)  # type: ignore[attr-defined]
            got = table.gather(known)
            width = max(expected.shape[1], got.shape[1])
            assert np.array_equal(
                np.pad(got, ((0, 0), (0, width - got.shape[1]))),
                np.pad(expected, ((0, 0), (0, width - expected.shape[1]))),
            ), (table.group, known)
        for seq in ids:
            if seq not in table:
                assert not manager.block_table(table.group, [seq]).any()  # type: ignore[attr-defined]


STEP = st.tuples(
    st.lists(st.integers(min_value=1, max_value=200), max_size=2),  # new prompts
    st.integers(min_value=1, max_value=96),  # prefill budget per sequence
    st.booleans(),  # abort the step instead of committing it
    st.booleans(),  # finish the oldest sequence after the step
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STEP, min_size=1, max_size=14))
def test_block_tables_follow_the_core_through_plans_aborts_and_finishes(steps: list) -> None:
    import prefixcache as pc

    config = pc.CacheConfig(
        pools=[pc.PoolConfig(num_blocks=400)],
        groups=[
            pc.FullAttention(block_size=16, pool=0),
            pc.SlidingWindow(block_size=16, window=32, pool=0),
        ],
        hash=pc.HashConfig(unit=8),
    )
    manager = pc.CacheManager(config)
    buffers = pc.PlanBuffers(rows=2)
    tables = [BlockTables(0, rows=1, width=1), BlockTables(1, rows=1, width=1)]
    live: list[int] = []
    next_id = 0
    for prompts, budget, abort, finish in steps:
        for length in prompts:
            manager.add(next_id, [t % 40 for t in range(length - 1)] + [next_id % 40])
            live.append(next_id)
            next_id += 1
        scheduled = []
        for seq in live:
            remaining = manager.num_tokens(seq) - manager.num_computed(seq)
            if remaining == 0:
                manager.append(seq, [seq % 40])
                remaining = 1
            result = manager.schedule(seq, min(remaining, budget))
            if result is not None and result.num_tokens:
                scheduled.append(seq)
        if not scheduled:
            continue
        manager.build_plan_into(buffers)
        for table in tables:
            table.apply_plan(buffers)
        ids = buffers.seq_ids[: buffers.num_rows].tolist()
        # While the plan is in flight the manager's tables are the plan's (a commit may then
        # release window blocks, which the next plan's `replaced` reports).
        assert_same_as_core(manager, tables, ids)
        if abort:
            manager.abort(buffers)
            for table in tables:
                table.rollback()
            assert_same_as_core(manager, tables, ids)
        else:
            manager.commit(buffers)
        if finish and live:
            seq = live.pop(0)
            manager.finish(seq)
            for table in tables:
                table.release(seq)


def test_a_step_from_a_step_plan_equals_the_step_from_buffers() -> None:
    # Twin managers take the same steps; one returns StepPlans, the other writes PlanBuffers
    # (longer arrays, sliced by the counts). The steps the kernels see are equal.
    import prefixcache as pc
    from conftest import hybrid_config
    from prefixcache.kernels import Step

    twins = [pc.CacheManager(hybrid_config(alignment=8, unit=8)) for _ in range(2)]
    buffers = pc.PlanBuffers(rows=1)
    tables = [BlockTables(0), BlockTables(0)]
    prompt = list(range(80))
    for seq_id, tokens in enumerate([prompt, [*prompt, 9], [*prompt[:50], 7]]):
        for manager in twins:
            manager.add(seq_id, tokens)
            manager.schedule(seq_id, len(tokens))
        plan = twins[0].build_plan()
        twins[1].build_plan_into(buffers)
        tables[0].apply_plan(plan)
        tables[1].apply_plan(buffers)
        steps = [Step.from_plan(plan, [tables[0]]), Step.from_plan(buffers, [tables[1]])]
        for a, b in zip(*(s.__dict__.values() for s in steps), strict=True):
            if isinstance(a, tuple):
                for part_a, part_b in zip(a, b, strict=True):
                    for x, y in zip(
                        part_a.__dict__.values(), part_b.__dict__.values(), strict=True
                    ):
                        assert np.array_equal(x, y), (part_a, part_b)
            elif isinstance(a, np.ndarray):
                assert np.array_equal(a, b)
        # The second prompt resumes at the first one's tail checkpoint (72), inside a block.
        assert (steps[0].copies.shape[0] == 1) == (seq_id == 1)
        twins[0].commit(plan)
        twins[1].commit(buffers)
