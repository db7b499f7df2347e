"""CUDA implementations of the TwELL ops.

Until the Triton kernels land, the CUDA path runs the device-agnostic PyTorch reference, which is
exact but synchronises the host (it gathers pairs with ``nonzero``).
"""

from __future__ import annotations

from twell_compile.kernels import reference


def forward(x2d, wg, wu, wd, bg, bu, bd, *, layer: int, training: bool):
    return reference.ffn_forward_ref(x2d, wg, wu, wd, bg, bu, bd), True


def backward(dout2d, x2d, wg, wu, wd, bg, bu, bd, packed, up_val, l1_scale):
    return reference.ffn_backward_ref(dout2d, x2d, wg, wu, wd, bg, bu, bd, packed, up_val, l1_scale)
