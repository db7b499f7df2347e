"""Per-layer counters the ops write on the device, read by ``twell_compile.stats()`` off the hot path.

Every op call overwrites its layer's small float64 buffer in place on the device: on CUDA the
op's counting kernel stores the call's record itself (``call_record``), on the CPU reference path
tensor ops do (``record``). No host synchronisation, and CUDA-graph capture simply replays the
writes. Reading the buffers (``snapshot``) synchronises, which is why only ``stats()`` does it.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

# Buffer layout, one float64 per field. The first five are a kernel's call record
# (``kernels.dense_rows.CallRecord``: calls, tokens, active, dense rows, flag = sparse).
FIELDS = ("calls", "tokens", "active", "dense_rows", "sparse", "l1")
_CALLS, _TOKENS, _ACTIVE, _DENSE_ROWS, _SPARSE, _L1 = range(len(FIELDS))

_lock = threading.Lock()
# (layer, device) -> (buffer, the record's int64 [3] scratch: zero between kernel launches)
_buffers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _state(layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (layer, str(device))
    state = _buffers.get(key)
    if state is None:
        with _lock:
            # Real buffers, even mid-compile, and normal ones, even when first made under
            # torch.inference_mode(): an inference tensor could not be updated in place outside it.
            with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.inference_mode(False):
                fresh = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
                fresh[_L1] = float("nan")  # no training call yet
                scratch = torch.zeros(3, dtype=torch.int64, device=device)
            state = _buffers.setdefault(key, (fresh, scratch))
    return state


def buffer(layer: int, device) -> torch.Tensor:
    """The layer's float64 buffer, one value per ``FIELDS`` entry (written on the device)."""
    return _state(layer, torch.device(device))[0]


def ensure(layer: int, device) -> None:
    """Allocate ``layer``'s buffer now (at rewrite time), not during a CUDA-graph warm-up, where
    it would land in the graph's memory pool as an untracked live allocation."""
    buffer(layer, device)


def record(layer: int, tokens: int, active: torch.Tensor, dense_rows: torch.Tensor, l1: Optional[torch.Tensor], sparse: bool) -> torch.Tensor:
    """Store one call's counters for ``layer``; all tensor arguments are device scalars.

    ``l1=None`` (inference, or a training call that did not measure it) keeps the last value.
    (The CUDA ops' kernels store their record themselves: ``call_record``.)

    Returns the layer's buffer.
    """
    buf = buffer(layer, active.device)
    nan = torch.full((), float("nan"), dtype=torch.float64, device=active.device)
    values = torch.stack(
        [
            buf[_CALLS] + 1,
            torch.full_like(nan, float(tokens)),
            active.to(torch.float64),
            dense_rows.to(torch.float64),
            torch.full_like(nan, 1.0 if sparse else 0.0),
            buf[_L1] if l1 is None else l1.detach().to(torch.float64),  # None: keep the last value
        ]
    )
    buf.copy_(values)
    return buf


def call_record(layer: int, device, sparse: bool):
    """Where the CUDA ops' counting kernel (``dense_list`` after the pair loop on the sparse path,
    ``dense_activation`` on the dense one) stores this call's calls, tokens, active entries, dense rows and path, in
    the launch it makes anyway: no tensor op of its own."""
    from twell_compile.kernels.dense_rows import CallRecord

    buf, scratch = _state(layer, torch.device(device))
    return CallRecord(buf[_CALLS:_SPARSE + 1], scratch, 1.0 if sparse else 0.0)


def record_l1(layer: int, l1: torch.Tensor) -> None:
    """Store a measured L1 value (a device scalar) for ``layer``."""
    buffer(layer, l1.device)[_L1].copy_(l1.detach())


def snapshot() -> dict[int, dict[str, float]]:
    """Read every layer's last counters (synchronises with the device)."""
    out: dict[int, dict[str, float]] = {}
    with _lock:
        items = list(_buffers.items())
    for (layer, _device), (buf, _) in sorted(items, key=lambda kv: kv[0]):
        values = dict(zip(FIELDS, buf.tolist()))
        prev = out.get(layer)
        if prev is None or values["calls"] > prev["calls"]:
            out[layer] = values
    return out


def reset() -> None:
    with _lock:
        _buffers.clear()
