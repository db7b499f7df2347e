"""TwELL ops: ``torch.library`` schemas, fake impls, autograd with the injected L1, device dispatch.

Importing this package registers ``torch.ops.twell.ffn``, ``torch.ops.twell.ffn_train`` and
``torch.ops.twell.ffn_bwd``. This layer knows nothing about FX graphs. Its public surface, the only
one ``twell_compile`` uses:

* the ops ``ffn``, ``ffn_train``, ``ffn_bwd``, and their counters (``telemetry``);
* ``l1_snapshot``: the copy of a live L1 coefficient that a training forward hands its backward;
* ``mark_cuda_graph_layers``: layers the backend compiles to run under CUDA graphs;
* ``mark_gathered_weight_layers``: layers whose weights are gathered per call (FSDP2), for which
  nothing is cached per weight;
* ``force_path("sparse" | "dense")``: a context manager forcing the CUDA path of every call in it;
* ``replays_off()``: a context manager in which no call is replayed from a CUDA graph
  (``call_replay``), for the bench's measure of what a call allocates; ``replay_stats()``: the
  graphs recorded so far, kept now, the memory they reserved, and what happened to the calls that
  could have been replayed (replayed, or eager and why; keys dropped or evicted);
* ``prefers_sparse`` and ``watch_counters``: a layer's measured preference, and its counters'
  copy for layers that ran compiled dense code (the backend's graph variants); ``first_launches``,
  which their step-time measurement checks so as not to time kernels compiling or tuning;
* for ``twell bench``: the TwELL layout (``DEFAULT_LAYOUT``, ``TILE_N``), the floors
  (``gather_floor``, ``active_pairs``) and the autotuner's choices (``tuned_configs``).
"""

from twell_compile.kernels import DEFAULT_LAYOUT, TILE_N

from . import telemetry
from .call_replay import replays_off
from .call_replay import stats as replay_stats
from .cuda_graphs import mark_cuda_graph_layers
from .dispatch_policy import force_path, prefers_sparse, watch_counters
from .ffn import ffn
from .ffn_bwd import ffn_bwd
from .ffn_train import ffn_train
from .weight_cache import mark_gathered_weight_layers
from .l1_snapshot import l1_snapshot
from .measure import active_pairs, first_launches, gather_floor, tuned_configs

__all__ = [
    "DEFAULT_LAYOUT",
    "TILE_N",
    "active_pairs",
    "ffn",
    "ffn_bwd",
    "ffn_train",
    "force_path",
    "gather_floor",
    "l1_snapshot",
    "mark_cuda_graph_layers",
    "mark_gathered_weight_layers",
    "prefers_sparse",
    "replay_stats",
    "replays_off",
    "telemetry",
    "tuned_configs",
    "first_launches",
    "watch_counters",
]
