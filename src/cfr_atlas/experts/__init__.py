"""The MoE expert store: routed-expert weights under one byte budget (the weights' Atlas).

`ExpertSource` reads one expert's matrices from the memory-mapped GGUF (one contiguous range
per expert per matrix); `ExpertStore` keeps experts in a bounded pool of slots, leases the ones
a step uses, evicts by a policy (`policies.py`) and counts what it did. The models call it;
`slots.py` lays an expert out in a slot and writes it (one-pass kernels in `repack.py`);
`prefetch.py` fills the slots of the experts predicted for the next layer on a background
thread. It imports only quant/ (no model, no GGUF reader).
"""

from cfr_atlas.experts.policies import POLICIES, FrequencyPolicy, LruPolicy, PinnedPolicy
from cfr_atlas.experts.source import ExpertMatrix, ExpertSource
from cfr_atlas.experts.store import ExpertStore, ExpertTelemetry

__all__ = ["POLICIES", "ExpertMatrix", "ExpertSource", "ExpertStore", "ExpertTelemetry",
           "FrequencyPolicy", "LruPolicy", "PinnedPolicy"]
