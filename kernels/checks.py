"""Argument checks shared by the Triton launchers: errors that name the argument at fault.

A wrong type or dtype raises ``TypeError``; a wrong shape or device raises ``ValueError``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .format import TwellLayout, TwellPacked

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, t, shape, dtypes, device: Optional[torch.device] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def check_matrix(name: str, t, dims: str) -> None:
    """``t`` is a 2-D tensor (checked before its sizes are read)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor {dims}, got {getattr(t, 'shape', type(t).__name__)}")


def check_ffn_operands(x, wg, wu, wd, bg, bu, bd, *, dout=None) -> tuple[int, int, int]:
    """Check one FFN's operands (``nn.Linear`` layouts); returns ``(M, D, H)``."""
    check_matrix("x", x, "[M, D]")
    check_matrix("wu", wu, "[H, D]")
    m, d = x.shape
    h = wu.shape[0]
    dev = x.device
    check_tensor("x", x, (m, d), FLOAT_DTYPES, dev)
    if dout is not None:
        check_tensor("dout", dout, (m, d), (x.dtype,), dev)
    check_tensor("wu", wu, (h, d), (x.dtype,), dev)
    check_tensor("wd", wd, (d, h), (x.dtype,), dev)
    if wg is not None:
        check_tensor("wg", wg, (h, d), (x.dtype,), dev)
    elif bg is not None:
        raise ValueError("bg was given without wg: a plain FFN has no gate bias")
    for name, b, n in (("bu", bu, h), ("bd", bd, d), ("bg", bg, h)):
        if b is not None:
            check_tensor(name, b, (n,), FLOAT_DTYPES, dev)
    return m, d, h


def check_packed(packed, m: int, h: int, layout: TwellLayout, device: torch.device) -> None:
    """``packed`` is a TwELL buffer of ``m`` rows and ``h`` columns in ``layout``."""
    if not isinstance(packed, TwellPacked):
        raise TypeError(f"packed must be a TwellPacked, got {type(packed).__name__}")
    n_tiles, slots = layout.n_tiles(h), layout.slots
    check_tensor("packed.idx", packed.idx, (m, n_tiles, slots), (torch.int32,), device)
    check_tensor("packed.val", packed.val, (m, n_tiles, slots), (torch.float32,), device)
    check_tensor("packed.count", packed.count, (m, n_tiles), (torch.int32,), device)


def check_row_list(row_list, m: int, device: torch.device) -> None:
    """``row_list`` is a ``row_lists.RowList`` of ``m`` rows: int32 ``rows [max(m, 1)]`` and int32
    ``n_dense [1]`` on ``device``."""
    check_tensor("row_list.rows", row_list.rows, (max(m, 1),), (torch.int32,), device)
    check_tensor("row_list.n_dense", row_list.n_dense, (1,), (torch.int32,), device)
