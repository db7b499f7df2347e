"""TwELL kernels: the format, its pure-PyTorch reference, and the Triton kernels.

This layer knows nothing about torch.compile. Triton modules are imported lazily by the ops that
launch them, so importing this package never needs a GPU.
"""

from .format import DEFAULT_LAYOUT, SLOTS_PER_TILE, TILE_N, TwellLayout, TwellPacked

__all__ = ["DEFAULT_LAYOUT", "SLOTS_PER_TILE", "TILE_N", "TwellLayout", "TwellPacked"]
