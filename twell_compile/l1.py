"""The L1 coefficient as live 0-d tensors, so changing it never recompiles.

Each rewritten graph (or patched model) holds one 0-d float32 tensor per device and passes it to
the training op. ``set_l1_coeff`` writes every live one in place: a schedule or a warm-up then
costs no recompile, and CUDA-graph replays read the new value.

A change applies from the next forward on, and never to a backward in flight: a forward hands its
backward a snapshot of the coefficient (``forward_value`` on the eager routes, a
``twell::l1_snapshot`` node at the top of each rewritten graph on the compile routes), and the live tensors are written through
``.data``, so no saved tensor's version changes under autograd.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .options import check_l1

_lock = threading.Lock()
_live: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()
_override: "float | None" = None  # the last set_l1_coeff value, for tensors created later
_generation = 0  # bumped by every write of the live tensors
_snapshots: dict[int, tuple[int, torch.Tensor]] = {}  # id(live tensor) -> (generation, snapshot)


def coefficient_tensor(value: float, device: torch.device | str) -> torch.Tensor:
    """A new live coefficient tensor on ``device``: ``value`` (the option), or the last
    ``set_l1_coeff`` value if one was set, so recompiles and late-built layers follow it. Real
    and normal even when made under a fake mode or ``torch.inference_mode()``."""
    value = value if _override is None else _override
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.inference_mode(False):
        t = torch.tensor(float(value), dtype=torch.float32, device=device)
    _live.add(t)
    return t


def set_l1_coeff(value: float) -> None:
    """Set the L1 coefficient of every rewritten layer (compiled or patched) without recompiling.

    It applies from the next forward on, and also to layers rewritten later (recompiles, new
    graphs, patched modules' first training call) until it is set again; ``clear_l1_override``
    returns to the options' values. A value that is not accepted changes nothing.

    Example::

        >>> for step in range(steps):
        ...     twell_compile.set_l1_coeff(2e-5 * min(1.0, step / 1000))  # linear warm-up
    """
    global _override
    check_l1(value, "set_l1_coeff(value)")
    with _lock:
        _override = float(value)
        write_all(float(value))


def write_all(value: float) -> None:
    """Write ``value`` into every live coefficient (through ``.data``: no version change)."""
    global _generation
    with torch.no_grad():
        for t in list(_live):
            t.data.fill_(value)
    _generation += 1


def changed() -> None:
    """The live coefficients were written on the device (the density controller): forwards from
    now on take a new snapshot."""
    global _generation
    _generation += 1


def forward_value(t: torch.Tensor) -> torch.Tensor:
    """The value of the live coefficient ``t`` for a forward starting now: a snapshot that no later
    write changes, made once per change of the coefficients (not per call)."""
    entry = _snapshots.get(id(t))
    if entry is not None and entry[0] == _generation:
        return entry[1]
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.inference_mode(False):
        snapshot = t.detach().clone()
    if entry is None:
        weakref.finalize(t, _snapshots.pop, id(t), None)
    _snapshots[id(t)] = (_generation, snapshot)
    return snapshot


def clear_l1_override() -> None:
    """Let layers rewritten from now on start from their ``l1_coeff`` option again."""
    global _override
    _override = None
