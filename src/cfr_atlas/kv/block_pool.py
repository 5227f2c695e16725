"""A paged K/V block pool and the per-sequence block table that reads and writes it.

`KvBlockPool` is plain data: two preallocated arrays
    k, v: (n_blocks, n_layers, n_kv_heads, block_tokens, head_dim) in `dtype.array_dtype`
a free list and one reference count per block. Invariants (checked by tests/kv/test_block_pool):
- refcount[b] == number of block tables that hold b (a table may hold b once);
- a block is free exactly when its refcount is 0; free list + used blocks == n_blocks;
- `allocate()` on an empty free list raises `KvPoolExhausted` before any state changes.

`PagedKvCache` is one sequence: a block table (block ids, token i lives in block i // B at
row i % B) and `n_tokens`. `fork()` shares every block; an append into a shared partial last
block first copies it (copy-on-write), so a fork never sees the other's rows. An append that
cannot get every block it needs raises before touching anything. It is also a `KvRegenerator`
for an `Atlas` whose page_tokens equals block_tokens.
This module does not hash, persist or evict blocks; prefix_cache.py and disk_store.py do.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.atlas.pages import PageKey
from cfr_atlas.atlas.storage import StorageDtype, round_rows, widen
from cfr_atlas.errors import DimensionError, KvPoolExhausted, NumericError, PageError


class KvBlockPool:
    """Preallocated K/V blocks with a free list and reference counts (see module docstring)."""

    def __init__(self, n_blocks: int, block_tokens: int, n_layers: int, n_kv_heads: int,
                 head_dim: int, dtype: StorageDtype):
        for name, value in (("n_blocks", n_blocks), ("block_tokens", block_tokens),
                            ("n_layers", n_layers), ("n_kv_heads", n_kv_heads),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DimensionError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(dtype, StorageDtype):
            raise DimensionError(f"dtype must be a StorageDtype, got {dtype!r}")
        self.n_blocks, self.block_tokens, self.dtype = n_blocks, block_tokens, dtype
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        shape = (n_blocks, n_layers, n_kv_heads, block_tokens, head_dim)
        self.k = np.zeros(shape, dtype=dtype.array_dtype)
        self.v = np.zeros(shape, dtype=dtype.array_dtype)
        self.refcount = np.zeros(n_blocks, dtype=np.int64)
        self.free: list[int] = list(range(n_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...

    @property
    def free_count(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        """A free block id with refcount 1; KvPoolExhausted (nothing changed) if none is left."""
        if not self.free:
            raise KvPoolExhausted(f"all {self.n_blocks} K/V blocks of {self.block_tokens} "
                                  "tokens are in use")
        block = self.free.pop()
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        self._check_used(block)
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; a block whose count reaches 0 returns to the free list."""
        self._check_used(block)
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)

    def _check_used(self, block: int) -> None:
        if not 0 <= block < self.n_blocks or self.refcount[block] < 1:
            raise PageError(f"block {block} is not an allocated block of this pool "
                            f"({self.n_blocks} blocks)")


class PagedKvCache:
    """The block table of one sequence over a shared `KvBlockPool` (see module docstring)."""

    def __init__(self, pool: KvBlockPool, page_tokens: int | None = None):
        if page_tokens is not None and page_tokens != pool.block_tokens:
            raise PageError(f"Atlas page_tokens {page_tokens} must equal the pool's "
                            f"block_tokens {pool.block_tokens}")
        self.pool = pool
        self.table: list[int] = []
        self.n_tokens = 0

    # --- writing -------------------------------------------------------------------------------
    def append(self, k_rows: np.ndarray, v_rows: np.ndarray) -> None:
        """Append rows (T, n_layers, n_kv_heads, head_dim) of tokens n_tokens..n_tokens+T-1.

        Rows are in the storage dtype (`dtype.array_dtype`) or float32, rounded here with
        `round_rows`. Raises KvPoolExhausted, with nothing changed, if the blocks (including a
        copy-on-write copy) are not all free.
        """
        k_st, v_st = self._storage_rows("k_rows", k_rows), self._storage_rows("v_rows", v_rows)
        if k_st.shape != v_st.shape:
            raise DimensionError(f"k_rows {k_st.shape} and v_rows {v_st.shape} differ in shape")
        n_new, B, pos = k_st.shape[0], self.pool.block_tokens, self.n_tokens
        cow = pos % B != 0 and self.pool.refcount[self.table[-1]] > 1
        need = int(cow) + -(-(pos + n_new) // B) - -(-pos // B)
        if need > self.pool.free_count:
            raise KvPoolExhausted(f"appending {n_new} tokens at {pos} needs {need} free blocks, "
                                  f"the pool has {self.pool.free_count} of {self.pool.n_blocks}")
        if cow:
            self._copy_last_block()
        self._write(pos, k_st, v_st)

    def append_block(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append one whole block given as (n_layers, n_kv_heads, block_tokens, head_dim)
        (the `KvBlock` layout); n_tokens must be on a block boundary."""
        if self.n_tokens % self.pool.block_tokens:
            raise PageError(f"a whole block cannot start at token {self.n_tokens} "
                            f"(block_tokens {self.pool.block_tokens})")
        self.append(k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3))

    def _storage_rows(self, name: str, rows) -> np.ndarray:
        p = self.pool
        want = (p.n_layers, p.n_kv_heads, p.head_dim)
        if not isinstance(rows, np.ndarray) or rows.ndim != 4 or rows.shape[1:] != want:
            raise DimensionError(f"{name} must be (tokens, {', '.join(map(str, want))}), "
                                 f"got {getattr(rows, 'shape', type(rows).__name__)}")
        if rows.dtype == p.dtype.array_dtype and p.dtype is not StorageDtype.FLOAT32:
            return rows  # 16-bit patterns, already rounded by the caller
        if rows.dtype != np.float32:
            raise DimensionError(f"{name} must be {p.dtype.array_dtype} or float32, "
                                 f"got {rows.dtype}")
        with np.errstate(over="ignore"):  # overflow to inf is caught just below
            stored = round_rows(rows, p.dtype)
        if not np.isfinite(widen(stored, p.dtype)).all():
            raise NumericError(f"{name} for tokens from {self.n_tokens} are not finite "
                               f"in {p.dtype.value}")
        return stored

    def _copy_last_block(self) -> None:
        p, old = self.pool, self.table[-1]
        new = p.allocate()
        p.k[new], p.v[new] = p.k[old], p.v[old]
        p.decref(old)
        self.table[-1] = new

    def _write(self, pos: int, k_st: np.ndarray, v_st: np.ndarray) -> None:
        p, B, i = self.pool, self.pool.block_tokens, 0
        while i < k_st.shape[0]:
            if pos % B == 0:
                self.table.append(p.allocate())
            block, row = self.table[-1], pos % B
            n = min(B - row, k_st.shape[0] - i)
            # rows (n, L, H, D) -> block slice (L, H, n, D)
            p.k[block, :, :, row:row + n] = k_st[i:i + n].transpose(1, 2, 0, 3)
            p.v[block, :, :, row:row + n] = v_st[i:i + n].transpose(1, 2, 0, 3)
            pos, i = pos + n, i + n
        self.n_tokens = pos

    # --- sharing -------------------------------------------------------------------------------
    def fork(self) -> PagedKvCache:
        """A new sequence sharing every block of this one (one more reference each)."""
        other = PagedKvCache(self.pool)
        for block in self.table:
            self.pool.incref(block)
        other.table, other.n_tokens = list(self.table), self.n_tokens
        return other

    def release(self) -> None:
        """Drop this sequence's references (blocks no one holds return to the pool)."""
        for block in self.table:
            self.pool.decref(block)
        self.table, self.n_tokens = [], 0

    def block_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of whole block `index` as (n_layers, n_kv_heads, block_tokens, head_dim)."""
        if not 0 <= index < self.n_tokens // self.pool.block_tokens:
            raise PageError(f"block {index} is not a whole block of a sequence of "
                            f"{self.n_tokens} tokens (block_tokens {self.pool.block_tokens})")
        block = self.table[index]
        return self.pool.k[block].copy(), self.pool.v[block].copy()

    # --- reading (the KvRegenerator protocol) --------------------------------------------------
    def regenerate_page(self, key: PageKey, tokens: range, k_out: np.ndarray,
                        v_out: np.ndarray) -> None:
        """Write float32 rows (len(tokens), head_dim) of key.layer / key.kv_head."""
        p, B = self.pool, self.pool.block_tokens
        start, n = key.start_token, len(tokens)
        if start % B or tokens.start != start or not 1 <= n <= B:
            raise PageError(f"{key}: tokens {tokens.start}..{tokens.stop - 1} are not one block "
                            f"of {B} tokens; the Atlas page_tokens must equal block_tokens {B}")
        if tokens.stop > self.n_tokens:
            raise PageError(f"{key}: tokens up to {tokens.stop - 1} requested, the sequence "
                            f"holds {self.n_tokens}")
        if not (0 <= key.layer < p.n_layers and 0 <= key.kv_head < p.n_kv_heads):
            raise PageError(f"{key}: outside {p.n_layers} layers x {p.n_kv_heads} K/V heads")
        block = self.table[start // B]
        k_out[...] = widen(p.k[block, key.layer, key.kv_head, :n], p.dtype)
        v_out[...] = widen(p.v[block, key.layer, key.kv_head, :n], p.dtype)
