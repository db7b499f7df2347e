"""What ``twell bench`` measures beside the ops, from the kernels: the floors of the sparse part
(``gather_floor`` over a problem's ``active_pairs``: the bytes ``sparse_ffn`` must read, with none
of its arithmetic; docs/benchmarks.md, 'Floors and targets'), the autotuner's choices of this
process (``tuned_configs``), and how many calls so far compiled or tuned a kernel or did a CUDA
graph's once-only work (``first_launches``), which a step-time measurement checks so as not to time that work.
Never used by the ops themselves.
"""

from twell_compile import kernels
from twell_compile.kernels import active_pairs, gather_floor, tuned_configs

from . import call_replay


def first_launches() -> int:
    """How many launches so far compiled or tuned a kernel (``kernels.first_launches``), plus how
    many calls did once-only work for their CUDA graph (``call_replay.warm_ups``: a key's eager
    first call, a recording): a timing taken while this count moved measured that work too."""
    return kernels.first_launches() + call_replay.warm_ups()

__all__ = ["active_pairs", "first_launches", "gather_floor", "tuned_configs"]
