"""Per-layer counters the ops write on the device, read by ``twell_compile.stats()`` off the hot path.

Every op call overwrites its layer's small float64 buffer in place with device-side tensor ops: no
host synchronisation, and CUDA-graph capture simply replays the writes. Reading the buffers
(``snapshot``) synchronises, which is why only ``stats()`` does it.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

# Buffer layout, one float64 per field.
FIELDS = ("calls", "tokens", "active", "dense_rows", "l1", "sparse")
_CALLS, _TOKENS, _ACTIVE, _DENSE_ROWS, _L1, _SPARSE = range(len(FIELDS))

_lock = threading.Lock()
_buffers: dict[tuple[int, str], torch.Tensor] = {}


def _buffer(layer: int, device: torch.device) -> torch.Tensor:
    key = (layer, str(device))
    buf = _buffers.get(key)
    if buf is None:
        with _lock:
            with torch._subclasses.fake_tensor.unset_fake_temporarily():  # a real buffer, even mid-compile
                fresh = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
                fresh[_L1] = float("nan")  # no training call yet
            buf = _buffers.setdefault(key, fresh)
    return buf


def ensure(layer: int, device) -> None:
    """Allocate ``layer``'s buffer now (at rewrite time), not during a CUDA-graph warm-up, where
    it would land in the graph's memory pool as an untracked live allocation."""
    _buffer(layer, torch.device(device))


def record(layer: int, tokens: int, active: torch.Tensor, dense_rows: torch.Tensor, l1: Optional[torch.Tensor], sparse: bool) -> torch.Tensor:
    """Store one call's counters for ``layer``; all tensor arguments are device scalars.

    ``l1=None`` (inference, or a training call that did not measure it) keeps the last value.
    (The CUDA ops' kernels add their counts into ``counters`` and call ``record_counted``.)

    Returns the layer's buffer.
    """
    buf = _buffer(layer, active.device)
    nan = torch.full((), float("nan"), dtype=torch.float64, device=active.device)
    values = torch.stack(
        [
            buf[_CALLS] + 1,
            torch.full_like(nan, float(tokens)),
            active.to(torch.float64),
            dense_rows.to(torch.float64),
            buf[_L1] if l1 is None else l1.detach().to(torch.float64),  # None: keep the last value
            torch.full_like(nan, 1.0 if sparse else 0.0),
        ]
    )
    buf.copy_(values)
    return buf


def counters(layer: int, device) -> torch.Tensor:
    """The layer's ``active`` and ``dense_rows`` fields, zeroed, as a float64 ``[2]`` view: a
    kernel adds this call's counts into it (``dense_rows.flag_rows``), then ``record_counted``
    stores the rest of the call."""
    view = _buffer(layer, torch.device(device))[_ACTIVE:_DENSE_ROWS + 1]
    view.zero_()
    return view


def record_counted(layer: int, tokens: int, l1: Optional[torch.Tensor], sparse: bool, device) -> torch.Tensor:
    """``record`` for a call whose counts a kernel already added to ``counters(layer, device)``:
    three small writes instead of building every field."""
    buf = _buffer(layer, torch.device(device))
    buf[_CALLS] += 1
    buf[_TOKENS].fill_(float(tokens))  # fill_, not item assignment: that copies from the host and syncs
    buf[_SPARSE].fill_(1.0 if sparse else 0.0)
    if l1 is not None:
        buf[_L1].copy_(l1.detach())
    return buf


def snapshot() -> dict[int, dict[str, float]]:
    """Read every layer's last counters (synchronises with the device)."""
    out: dict[int, dict[str, float]] = {}
    with _lock:
        items = list(_buffers.items())
    for (layer, _device), buf in sorted(items, key=lambda kv: kv[0]):
        values = dict(zip(FIELDS, buf.tolist()))
        prev = out.get(layer)
        if prev is None or values["calls"] > prev["calls"]:
            out[layer] = values
    return out


def reset() -> None:
    with _lock:
        _buffers.clear()
