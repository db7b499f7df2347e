"""The L1 coefficient as live 0-d tensors, so changing it never recompiles.

Each rewritten graph (or patched model) holds one 0-d float32 tensor on its device and passes it
to the training op. ``set_l1_coeff`` writes every live one in place: a schedule or a warm-up then
costs no recompile, and CUDA-graph replays read the new value.
"""

from __future__ import annotations

import weakref

import torch

from .options import _check_l1

_live: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()
_override: "float | None" = None  # the last set_l1_coeff value, for tensors created later


def coefficient_tensor(value: float, device: torch.device | str) -> torch.Tensor:
    """A new live coefficient tensor on ``device``: ``value`` (the option), or the last
    ``set_l1_coeff`` value if one was set, so recompiles and late-built layers follow it."""
    value = value if _override is None else _override
    t = torch.tensor(float(value), dtype=torch.float32, device=device)
    _live.add(t)
    return t


def set_l1_coeff(value: float) -> None:
    """Set the L1 coefficient of every rewritten layer (compiled or patched) without recompiling.

    It also applies to layers rewritten later (recompiles, new graphs, patched modules' first
    training call) until it is set again; ``clear_l1_override`` returns to the options' values.

    Example::

        >>> for step in range(steps):
        ...     twell_compile.set_l1_coeff(2e-5 * min(1.0, step / 1000))  # linear warm-up
    """
    global _override
    _check_l1(value, "set_l1_coeff(value)")
    _override = float(value)
    with torch.no_grad():
        for t in list(_live):
            t.fill_(float(value))


def clear_l1_override() -> None:
    """Let layers rewritten from now on start from their ``l1_coeff`` option again."""
    global _override
    _override = None
