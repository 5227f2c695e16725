"""Boundary checks shared by the ops: dtype, rank, shape and `out=` buffers.

Holds only validation that raises `DimensionError` with the offending numbers; no math.
Kernels behind these checks trust their inputs.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.errors import DimensionError

F32 = np.dtype(np.float32)


def as_f32(name: str, a: np.ndarray, ndim: int | None = None) -> np.ndarray:
    """Return `a` as a C-contiguous float32 array, refusing other dtypes and ranks.

    A non-contiguous float32 view is copied (values are unchanged, so results are too).
    """
    if not isinstance(a, np.ndarray):
        raise DimensionError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != F32:
        raise DimensionError(f"{name} must be float32, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise DimensionError(f"{name} must have {ndim} dims, got shape {a.shape}")
    return np.ascontiguousarray(a)


def out_buffer(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """Return `out` after checking it is a C-contiguous float32 array of `shape`, or a new one."""
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != F32 or out.shape != shape:
        got = (getattr(out, "shape", None), getattr(out, "dtype", type(out).__name__))
        raise DimensionError(f"out must be float32 of shape {shape}, got shape/dtype {got}")
    if not out.flags.c_contiguous:
        raise DimensionError(f"out must be C-contiguous (shape {shape})")
    return out
