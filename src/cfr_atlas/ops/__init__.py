"""Pure array functions for the forward pass: RMS norm, RoPE, activations.

Every op takes float32 arrays, states its shape contract in the first docstring line, accepts
an optional `out=` and gives a token row the same bits whatever batch it is computed in.
This package imports nothing of cfr_atlas except `errors`; it holds no weights, caches or
attention (those live in quant/, kv/ and atlas/).
"""

from cfr_atlas.ops.activations import gated_halves, geglu, gelu, silu, softcap, swiglu
from cfr_atlas.ops.block_select import block_means, block_select
from cfr_atlas.ops.indexer import lightning_indexer_topk
from cfr_atlas.ops.norm import rms_norm, rms_norm_per_head
from cfr_atlas.ops.rope import (
    RopeMode,
    apply_rope,
    rope_cos_sin,
    rope_freqs,
    rotate,
    yarn_freqs,
)
from cfr_atlas.ops.wht import wht

__all__ = [
    "RopeMode",
    "apply_rope",
    "block_means",
    "block_select",
    "gated_halves",
    "geglu",
    "lightning_indexer_topk",
    "gelu",
    "rms_norm",
    "rms_norm_per_head",
    "rope_cos_sin",
    "rope_freqs",
    "rotate",
    "silu",
    "softcap",
    "swiglu",
    "wht",
    "yarn_freqs",
]
