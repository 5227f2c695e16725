"""Which model class runs which GGUF `general.architecture`: one table, no isinstance switches.

Every family class takes a `GGUFFile` and offers the same surface to sessions, generation and
the regenerators: `config` (n_layers, n_kv_heads, head_dim, value_dim (None, or V is a view of
K's first columns), dim, vocab_size, context_length, `kv_bytes(n_tokens, itemsize)`,
`window(layer)`), `forward_chunk`, `forward_batch`, `embed`, `head_kv`.
This module holds only the table and the two look-ups.
"""

from __future__ import annotations

import importlib

from cfr_atlas.errors import ConfigError, UnsupportedArchitectureError
from cfr_atlas.models.gguf_io import GGUFFile
from cfr_atlas.models.llama import LlamaConfig, LlamaModel

# architecture -> (model class, config class); the other families' modules are imported when a
# file of theirs is opened (module name, model class name, config class name), so a Llama
# start-up does not load them
FAMILIES = {
    "llama": (LlamaModel, LlamaConfig),  # with expert_count > 0: Mixtral's layout
    "qwen2": (LlamaModel, LlamaConfig),
    "qwen2moe": (LlamaModel, LlamaConfig),
    "qwen3moe": (LlamaModel, LlamaConfig),
    "olmoe": (LlamaModel, LlamaConfig),
    "gemma3": ("cfr_atlas.models.gemma3", "Gemma3Model", "Gemma3Config"),
    # MLA: one latent K/V stream per layer
    "deepseek2": ("cfr_atlas.models.deepseek2", "DeepSeek2Model", "DeepSeek2Config"),
}


def _family(gf: GGUFFile):
    arch = gf.meta("general.architecture")
    if arch not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"{gf.path.name}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(FAMILIES))})")
    family = FAMILIES[arch]
    if isinstance(family[0], str):
        module = importlib.import_module(family[0])
        family = (getattr(module, family[1]), getattr(module, family[2]))
    return family


def load_net(gf: GGUFFile, *, matmul: str = "float", **experts):
    """The model (config + weights + forward) for the file's architecture; `matmul` the
    arithmetic of its layer products ("float" or "int8"); `experts` (expert_budget,
    expert_policy, routing_profile) for the MoE families, refused by the others."""
    cls = _family(gf)[0]
    if experts and cls is not LlamaModel:
        raise ConfigError("expert_budget", f"{gf.path.name} ({gf.meta('general.architecture')})"
                          " has no experts to budget")
    return cls(gf, matmul=matmul, **experts)


def config_of(gf: GGUFFile):
    """The family config of the file, without loading weights."""
    return _family(gf)[1].from_gguf(gf)
