"""KvBlockPool and PagedKvCache as plain data: allocation, sharing, copy-on-write, exhaustion,
and a stateful check of the pool invariants against a model of every sequence's rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cfr_atlas.atlas import PageKey, StorageDtype, round_rows, widen
from cfr_atlas.errors import DimensionError, KvPoolExhausted, NumericError, PageError
from cfr_atlas.kv import KvBlockPool, PagedKvCache


def _rows(rng, n, L=1, H=1, D=4) -> np.ndarray:
    return rng.standard_normal((n, L, H, D)).astype(np.float32)


def _read(seq: PagedKvCache, layer=0, head=0) -> tuple[np.ndarray, np.ndarray]:
    """All rows of one head, read back through regenerate_page, page by page."""
    B, D = seq.pool.block_tokens, seq.pool.head_dim
    k, v = np.zeros((seq.n_tokens, D), np.float32), np.zeros((seq.n_tokens, D), np.float32)
    for start in range(0, seq.n_tokens, B):
        tokens = range(start, min(start + B, seq.n_tokens))
        seq.regenerate_page(PageKey(layer, head, start), tokens, k[start:tokens.stop],
                            v[start:tokens.stop])
    return k, v


def _stored(rows: np.ndarray, dtype: StorageDtype) -> np.ndarray:
    return widen(round_rows(rows, dtype), dtype)


def test_allocate_free_reuse_and_exhaustion():
    pool = KvBlockPool(3, 4, 1, 1, 4, StorageDtype.FLOAT32)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and pool.free_count == 0
    with pytest.raises(KvPoolExhausted, match="all 3 K/V blocks"):
        pool.allocate()
    assert pool.free_count == 0 and list(pool.refcount) == [1, 1, 1]
    pool.incref(blocks[1])
    pool.decref(blocks[1])
    assert pool.free_count == 0
    pool.decref(blocks[1])
    assert pool.free == [blocks[1]] and pool.allocate() == blocks[1]
    with pytest.raises(PageError, match="block 7"):
        pool.decref(7)


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write():
    rng = np.random.default_rng(0)
    pool = KvBlockPool(8, 4, 1, 1, 4, StorageDtype.FLOAT16)
    a = PagedKvCache(pool)
    first = _rows(rng, 6)
    a.append(first, -first)
    b = a.fork()
    assert b.table == a.table and list(pool.refcount[a.table]) == [2, 2]
    more_a, more_b = _rows(rng, 3), _rows(rng, 5)
    a.append(more_a, -more_a)                       # copy-on-write of the shared block 1
    assert a.table[0] == b.table[0] and a.table[1] != b.table[1]
    assert pool.refcount[a.table[0]] == 2 and pool.refcount[b.table[1]] == 1
    b.append(more_b, -more_b)                       # b now owns block 1 alone: written in place
    for seq, rows in ((a, np.concatenate([first, more_a])), (b, np.concatenate([first, more_b]))):
        k, v = _read(seq)
        assert np.array_equal(k, _stored(rows[:, 0, 0], StorageDtype.FLOAT16))
        assert np.array_equal(v, _stored(-rows[:, 0, 0], StorageDtype.FLOAT16))
    a.release()
    b.release()
    assert pool.free_count == 8 and not pool.refcount.any()


def test_fork_on_a_block_boundary_needs_no_copy():
    pool = KvBlockPool(4, 2, 1, 1, 4, StorageDtype.FLOAT32)
    a = PagedKvCache(pool)
    a.append(np.ones((4, 1, 1, 4), np.float32), np.ones((4, 1, 1, 4), np.float32))
    b = a.fork()
    b.append(np.zeros((1, 1, 1, 4), np.float32), np.zeros((1, 1, 1, 4), np.float32))
    assert b.table[:2] == a.table and pool.free_count == 1


def test_exhausted_append_changes_nothing():
    pool = KvBlockPool(3, 2, 1, 1, 4, StorageDtype.BFLOAT16)
    a = PagedKvCache(pool)
    a.append(np.ones((3, 1, 1, 4), np.float32), np.ones((3, 1, 1, 4), np.float32))
    b = a.fork()
    before = (list(pool.free), pool.refcount.copy(), pool.k.copy(), list(b.table), b.n_tokens)
    with pytest.raises(KvPoolExhausted, match="needs 3 free blocks, the pool has 1 of 3"):
        b.append(np.zeros((4, 1, 1, 4), np.float32), np.zeros((4, 1, 1, 4), np.float32))
    after = (list(pool.free), pool.refcount.copy(), pool.k.copy(), list(b.table), b.n_tokens)
    assert before[0] == after[0] and before[3:] == after[3:]
    assert np.array_equal(before[1], after[1]) and np.array_equal(before[2], after[2])


def test_append_checks_shapes_dtypes_and_values():
    pool = KvBlockPool(2, 2, 1, 2, 4, StorageDtype.FLOAT16)
    seq = PagedKvCache(pool)
    with pytest.raises(DimensionError, match=r"\(tokens, 1, 2, 4\)"):
        seq.append(np.zeros((2, 1, 1, 4), np.float32), np.zeros((2, 1, 1, 4), np.float32))
    with pytest.raises(DimensionError, match="float64"):
        seq.append(np.zeros((2, 1, 2, 4)), np.zeros((2, 1, 2, 4)))
    big = np.full((1, 1, 2, 4), 1e6, np.float32)
    with pytest.raises(NumericError, match="not finite in float16"):
        seq.append(big, big)
    bits = np.full((1, 1, 2, 4), 0x3C00, np.uint16)  # 1.0 in float16, already rounded
    seq.append(bits, bits)
    assert seq.n_tokens == 1 and pool.k[seq.table[0], 0, 0, 0, 0] == 0x3C00


class PoolMachine(RuleBasedStateMachine):
    """Sequences appended, forked and released at random over an 8-block pool; every rule is
    checked against a plain list of rows per sequence."""

    def __init__(self):
        super().__init__()
        self.pool = KvBlockPool(8, 3, 1, 1, 4, StorageDtype.FLOAT16)
        self.seqs: list[tuple[PagedKvCache, list[np.ndarray]]] = []
        self.rng = np.random.default_rng(0)

    def _snapshot(self):
        return (list(self.pool.free), self.pool.refcount.tolist(), self.pool.k.tobytes(),
                self.pool.v.tobytes(), [(list(s.table), s.n_tokens) for s, _ in self.seqs])

    @precondition(lambda self: len(self.seqs) < 5)
    @rule()
    def new_sequence(self):
        self.seqs.append((PagedKvCache(self.pool), []))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 4), n=st.integers(1, 4))
    def append(self, i, n):
        seq, rows = self.seqs[i % len(self.seqs)]
        new = _rows(self.rng, n)
        before = self._snapshot()
        try:
            seq.append(new, new * 2)
        except KvPoolExhausted:
            assert self._snapshot() == before
            return
        rows.extend(new)

    @precondition(lambda self: self.seqs and len(self.seqs) < 5)
    @rule(i=st.integers(0, 4))
    def fork(self, i):
        seq, rows = self.seqs[i % len(self.seqs)]
        self.seqs.append((seq.fork(), list(rows)))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 4))
    def release(self, i):
        seq, _ = self.seqs.pop(i % len(self.seqs))
        seq.release()

    @invariant()
    def refcounts_match_tables(self):
        held = np.zeros(self.pool.n_blocks, dtype=np.int64)
        for seq, _ in self.seqs:
            assert len(set(seq.table)) == len(seq.table)
            held[seq.table] += 1
        assert np.array_equal(held, self.pool.refcount)
        free = set(self.pool.free)
        assert len(free) == len(self.pool.free), "a block is on the free list twice"
        assert free == set(np.flatnonzero(held == 0).tolist()), "free list != unreferenced"
        assert len(free) + int((held > 0).sum()) == self.pool.n_blocks

    @invariant()
    def rows_read_back(self):
        for seq, rows in self.seqs:
            assert seq.n_tokens == len(rows)
            assert len(seq.table) == -(-len(rows) // self.pool.block_tokens)
            if rows:
                want = _stored(np.stack(rows)[:, 0, 0], StorageDtype.FLOAT16)
                k, v = _read(seq)
                assert np.array_equal(k, want) and np.array_equal(v, want * 2)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
