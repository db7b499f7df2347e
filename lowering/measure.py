"""What ``twell bench`` measures beside the ops, from the kernels: the floors of the sparse part
(``gather_floor`` over a problem's ``active_pairs``: the bytes ``sparse_ffn`` must read, with none
of its arithmetic; docs/benchmarks.md, 'Floors and targets'), the autotuner's choices of this
process (``tuned_configs``), and how many launches compiled or tuned a kernel so far
(``first_launches``), which a step-time measurement checks so as not to time that work. Never
used by the ops themselves.
"""

from twell_compile.kernels import active_pairs, first_launches, gather_floor, tuned_configs

__all__ = ["active_pairs", "first_launches", "gather_floor", "tuned_configs"]
