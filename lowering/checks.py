"""Argument checks shared by the TwELL ops: clear errors that name the argument at fault."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_ffn_args(x: Tensor, wg: Optional[Tensor], wu: Tensor, wd: Tensor, bg: Optional[Tensor], bu: Optional[Tensor], bd: Optional[Tensor]) -> None:
    """Raise ``ValueError`` unless the arguments describe one FFN in one dtype on one device.

    Shapes follow ``nn.Linear``: ``x [..., D]``, ``wg``/``wu`` ``[H, D]``, ``wd`` ``[D, H]``,
    ``bg``/``bu`` ``[H]``, ``bd`` ``[D]``.
    """
    # Every call checks; valid arguments pass in one run of comparisons (host time), and anything
    # else goes through the checks that name the argument at fault.
    dtype, device = x.dtype, x.device
    if dtype in SUPPORTED_DTYPES and x.dim() >= 1 and wu.dim() == 2 and (bg is None or wg is not None):
        hidden, d_model = wu.shape
        if (x.shape[-1] == d_model and wu.dtype == dtype and wu.device == device
                and _fits(wd, (d_model, hidden), dtype, device) and _fits(wg, (hidden, d_model), dtype, device)
                and _fits(bg, (hidden,), dtype, device) and _fits(bu, (hidden,), dtype, device)
                and _fits(bd, (d_model,), dtype, device)):
            return
    _name_the_fault(x, wg, wu, wd, bg, bu, bd)


def _fits(t: Optional[Tensor], shape: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    return t is None or (t.shape == shape and t.dtype == dtype and t.device == device)


def _name_the_fault(x, wg, wu, wd, bg, bu, bd) -> None:
    """``check_ffn_args``' checks one by one, raising for the first argument at fault."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"twell: x has dtype {x.dtype}; supported: float16, bfloat16, float32 (float64 on CPU)")
    if x.dim() < 1:
        raise ValueError("twell: x must have at least one dimension (the feature dimension D)")
    if wu.dim() != 2 or wd.dim() != 2:
        raise ValueError(f"twell: wu and wd must be 2-D nn.Linear weights, got {tuple(wu.shape)} and {tuple(wd.shape)}")
    hidden, d_model = wu.shape
    expected = {
        "wg": (wg, (hidden, d_model)),
        "wd": (wd, (d_model, hidden)),
        "bg": (bg, (hidden,)),
        "bu": (bu, (hidden,)),
        "bd": (bd, (d_model,)),
    }
    if x.shape[-1] != d_model:
        raise ValueError(f"twell: x has {x.shape[-1]} features but wu is [H={hidden}, D={d_model}]")
    for name, (t, shape) in expected.items():
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"twell: {name} has shape {tuple(t.shape)}, expected {shape} for D={d_model}, H={hidden}")
        if t.dtype != x.dtype:
            raise ValueError(f"twell: {name} has dtype {t.dtype} but x has {x.dtype}; cast them to one dtype")
        if t.device != x.device:
            raise ValueError(f"twell: {name} is on {t.device} but x is on {x.device}")
    if wu.dtype != x.dtype or wu.device != x.device:
        raise ValueError(f"twell: wu is {wu.dtype} on {wu.device} but x is {x.dtype} on {x.device}")
    if bg is not None and wg is None:
        raise ValueError("twell: bg (gate bias) given without wg (gate weight)")


def check_l1_args(x: Tensor, l1_coeff: Tensor, l1_factor: Tensor) -> None:
    """The L1 arguments of the training ops: 0-d tensors on x's device."""
    for name, t in (("l1_coeff", l1_coeff), ("l1_factor", l1_factor)):
        if not isinstance(t, Tensor):
            raise ValueError(f"twell: {name} must be a 0-d tensor, got {type(t).__name__}")
        if t.dim() != 0:
            raise ValueError(f"twell: {name} must be a 0-d tensor, got shape {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"twell: {name} is on {t.device} but x is on {x.device}")


def check_dout(dout: Tensor, x: Tensor) -> None:
    if tuple(dout.shape) != tuple(x.shape):
        raise ValueError(f"twell: dout has shape {tuple(dout.shape)}, expected x's shape {tuple(x.shape)}")
    if dout.device != x.device:
        raise ValueError(f"twell: dout is on {dout.device} but x is on {x.device}")
