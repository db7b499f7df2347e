"""What ``twell bench`` measures beside the ops, from the kernels: the floors of the sparse part
(``gather_floor`` over a problem's ``active_pairs``: the bytes ``sparse_ffn`` must read, with none
of its arithmetic; docs/benchmarks.md, 'Floors and targets') and the autotuner's choices of this
process (``tuned_configs``). Never used by the ops themselves.
"""

from twell_compile.kernels import active_pairs, gather_floor, tuned_configs

__all__ = ["active_pairs", "gather_floor", "tuned_configs"]
