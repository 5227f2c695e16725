"""The K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256-weight super-blocks with per-sub-block scales
(what Q4_K_M files are mostly made of). Each unpacks its bytes into subblock.Fields, folding the
super-block scale into float32 sub-block scales at load time; layout, kernels, twin and row reader
are subblock.py's. Q6_K and Q3_K also unpack into `SuperScaled` (d and the integer sub-block
scales apart), what their integer path keeps (int8_sub16.py).

Not here: kernels of their own, shape checks (weight.py), quantization.
"""

# Super-blocks of QK_K = 256 weights, little-endian f16 scales d (and dmin). Within a super-block,
# weight e is bit-plane packed (subblock.bit_fields): a group of L bytes holds 8 / width planes.
#
# Q4_K, 144 bytes: d | dmin | scales 12 x u8 | qs 128 x u8. Eight sub-blocks of 32; 6-bit sc_s and
#   m_s packed in the 12 bytes: for s < 4 sc = b[s] & 63, m = b[s + 4] & 63; for s >= 4
#   sc = (b[s + 4] & 15) | (b[s - 4] >> 6) << 4, m = (b[s + 4] >> 4) | (b[s] >> 6) << 4.
#   Weight 64 c + 32 h + j is nibble h of qs[32 c + j]. w = (d * sc_s) * q - (dmin * m_s).
# Q5_K, 176 bytes: d | dmin | scales 12 | qh 32 | qs 128: Q4_K plus a fifth bit, weight 32 i + j
#   taking bit i of qh[j]. w as Q4_K with q in 0..31.
# Q6_K, 210 bytes: ql 128 | qh 64 | scales 16 x i8 | d. Sixteen sub-blocks of 16; weight
#   128 a + 64 h + j has low nibble h of ql[64 a + j], weight 128 a + 32 i + j high bits
#   (qh[32 a + j] >> 2 i) & 3. w = (d * sc_s) * (q - 32).
# Q2_K, 84 bytes: scales 16 x u8 | qs 64 | d | dmin. Sixteen sub-blocks of 16, sc_s the low and
#   m_s the high nibble of scales[s]; weight 128 a + 32 i + j is (qs[32 a + j] >> 2 i) & 3.
#   w = (d * sc_s) * q - (dmin * m_s).
# Q3_K, 110 bytes: hmask 32 | qs 64 | scales 12 | d. Sixteen sub-blocks of 16; low 2 bits as
#   Q2_K, weight 32 i + j has high bit i of hmask[j]; q = low - 4 when that bit is 0, else low.
#   6-bit sc_s = (nibble s of scales[0:8], planes as above) | (2-bit field s of scales[8:12]) << 4,
#   minus 32. w = (d * sc_s) * q.

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cfr_atlas.quant import subblock
from cfr_atlas.quant.formats import BLOCKS, QType
from cfr_atlas.quant.subblock import Fields, Offset, bit_fields

QK_K = 256
F16 = "<f2"
Q4_K_BLOCK = np.dtype([("d", F16), ("dmin", F16), ("scales", "u1", (12,)),
                       ("qs", "u1", (QK_K // 2,))])
Q5_K_BLOCK = np.dtype([("d", F16), ("dmin", F16), ("scales", "u1", (12,)),
                       ("qh", "u1", (QK_K // 8,)), ("qs", "u1", (QK_K // 2,))])
Q6_K_BLOCK = np.dtype([("ql", "u1", (QK_K // 2,)), ("qh", "u1", (QK_K // 4,)),
                       ("scales", "i1", (QK_K // 16,)), ("d", F16)])
Q2_K_BLOCK = np.dtype([("scales", "u1", (QK_K // 16,)), ("qs", "u1", (QK_K // 4,)),
                       ("d", F16), ("dmin", F16)])
Q3_K_BLOCK = np.dtype([("hmask", "u1", (QK_K // 8,)), ("qs", "u1", (QK_K // 4,)),
                       ("scales", "u1", (12,)), ("d", F16)])
BLOCK_DTYPES = {QType.Q4_K: Q4_K_BLOCK, QType.Q5_K: Q5_K_BLOCK, QType.Q6_K: Q6_K_BLOCK,
                QType.Q2_K: Q2_K_BLOCK, QType.Q3_K: Q3_K_BLOCK}
for _qtype, _dtype in BLOCK_DTYPES.items():
    assert _dtype.itemsize == BLOCKS[_qtype].bytes and BLOCKS[_qtype].elements == QK_K

# Rounding facts. f16 -> f32 is exact and so is d * sc (11 bits times at most 8), so the
# sub-block scales a_s = d * sc_s and offsets dmin * m_s are exact. a_s * q is exact too for
# Q2_K, Q3_K, Q4_K, Q5_K (at most 17 + 5 bits) but not for Q6_K (19 + 6 bits): gguf-py rounds
# that product once and so does `subblock.values`; the kernels never form it (they multiply a_s
# by the sub-block's sum of q * x). The offset c_s = dmin * m_s is subtracted, as gguf-py does.


def _planes(b: np.ndarray, group: int, width: int) -> np.ndarray:
    """b (rows, nb, n) bit-plane packed in groups of `group` bytes -> (rows, nb * values)."""
    rows, nb, n = b.shape
    return bit_fields(b.reshape(rows, nb, n // group, group), width).reshape(rows, -1)


def _scaled(d: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """d (rows, nb) f16, sc (rows, nb, n_sub) integers -> (rows, nb * n_sub) float32 d * sc."""
    return (d.astype(np.float32)[..., None] * sc.astype(np.float32)).reshape(d.shape[0], -1)


def _scale_min_k4(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K scales (rows, nb, 12) uint8 -> 6-bit sc, m (rows, nb, 8) uint8."""
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def _k4_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks -> a = d * sc, c = dmin * m, each (rows, nb * 8) float32."""
    sc, m = _scale_min_k4(blocks["scales"])
    return _scaled(blocks["d"], sc), _scaled(blocks["dmin"], m)


def _view(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(raw).view(dtype)  # (rows, nb)


def q4_k_fields(raw: np.ndarray) -> Fields:
    blocks = _view(raw, Q4_K_BLOCK)
    return Fields(*_k4_scales(blocks), _planes(blocks["qs"], 32, 4).view(np.int8))


def q5_k_fields(raw: np.ndarray) -> Fields:
    blocks = _view(raw, Q5_K_BLOCK)
    q = _planes(blocks["qs"], 32, 4) | (_planes(blocks["qh"], 32, 1) << np.uint8(4))
    return Fields(*_k4_scales(blocks), q.view(np.int8))


class SuperScaled(NamedTuple):
    """Q6_K's or Q3_K's bytes unpacked, scales not yet multiplied: w = (d * sc_s) * q."""

    d: np.ndarray  # (rows, nb) f16 super-block scales
    sc: np.ndarray  # (rows, nb, 16) int8 sub-block scales, one per 16 weights
    q: np.ndarray  # (rows, nb * 256) int8 weights


def _fields(s: SuperScaled) -> Fields:
    return Fields(_scaled(s.d, s.sc), None, s.q)


def q6_k_scaled(raw: np.ndarray) -> SuperScaled:
    """sc in -128..127, q in -32..31."""
    blocks = _view(raw, Q6_K_BLOCK)
    q = _planes(blocks["ql"], 64, 4) | (_planes(blocks["qh"], 32, 2) << np.uint8(4))
    return SuperScaled(blocks["d"], blocks["scales"], q.view(np.int8) - np.int8(32))


def q6_k_fields(raw: np.ndarray) -> Fields:
    return _fields(q6_k_scaled(raw))


def q2_k_fields(raw: np.ndarray) -> Fields:
    blocks = _view(raw, Q2_K_BLOCK)
    sc = blocks["scales"]
    a, c = _scaled(blocks["d"], sc & 0x0F), _scaled(blocks["dmin"], sc >> 4)
    return Fields(a, c, _planes(blocks["qs"], 32, 2).view(np.int8))


def q3_k_scaled(raw: np.ndarray) -> SuperScaled:
    """sc in -32..31, q in -4..3."""
    blocks = _view(raw, Q3_K_BLOCK)
    b = blocks["scales"]
    sc = _planes(b[..., :8], 8, 4) | (_planes(b[..., 8:], 4, 2) << np.uint8(4))
    sc = sc.reshape(b.shape[:2] + (-1,)).view(np.int8) - np.int8(32)
    low = _planes(blocks["qs"], 32, 2).view(np.int8)
    high = _planes(blocks["hmask"], 32, 1).view(np.int8)
    return SuperScaled(blocks["d"], sc, low - ((np.int8(1) - high) << np.int8(2)))


def q3_k_fields(raw: np.ndarray) -> Fields:
    return _fields(q3_k_scaled(raw))


CODECS = (
    subblock.codec(QType.Q4_K, q4_k_fields, 32, Offset.SUBTRACT),
    subblock.codec(QType.Q5_K, q5_k_fields, 32, Offset.SUBTRACT),
    subblock.codec(QType.Q6_K, q6_k_fields, 16, Offset.NONE),
    subblock.codec(QType.Q2_K, q2_k_fields, 16, Offset.SUBTRACT),
    subblock.codec(QType.Q3_K, q3_k_fields, 16, Offset.NONE),
)
