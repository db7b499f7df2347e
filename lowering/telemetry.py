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

from twell_compile.kernels import CallRecord, TwellPacked, reference, stamp_fired, warm_stamp_fired

# Buffer layout, one float64 per field. The first five are a kernel's call record
# (the kernels' ``CallRecord``: calls, tokens, active, dense rows, flag = sparse).
FIELDS = ("calls", "tokens", "active", "dense_rows", "sparse", "l1")
_CALLS, _TOKENS, _ACTIVE, _DENSE_ROWS, _SPARSE, _L1 = range(len(FIELDS))

_lock = threading.Lock()
# (layer, device) -> (buffer, the record's int64 [3] scratch: zero between kernel launches)
_buffers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
# The same states by (layer, device as the caller names it), and each call record by (layer,
# device, sparse): found per call without making a device name or a view (host time).
_by_caller: dict = {}
_records: dict = {}


def device_key(device) -> str:
    """``device``'s name with its index: "cuda" names the current CUDA device, so that a state asked
    for by "cuda" is the one the ops find by their tensors' "cuda:0"."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _state(layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    state = _by_caller.get((layer, device))
    if state is not None:
        return state
    key = (layer, device_key(device))
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
    _by_caller[(layer, device)] = state
    return state


def buffer(layer: int, device) -> torch.Tensor:
    """The layer's float64 buffer, one value per ``FIELDS`` entry (written on the device)."""
    return _state(layer, device)[0]


def ensure(layer: int, device, hidden: Optional[int] = None) -> None:
    """Allocate ``layer``'s buffers now (at rewrite time), not during a CUDA-graph warm-up, where
    they would land in the graph's memory pool as untracked live allocations: its counters and,
    with ``hidden``, its dead-neuron state."""
    buffer(layer, device)
    if hidden is not None:
        fired_state(layer, device, hidden)


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
    found = _records.get((layer, device, sparse))
    if found is None:
        buf, scratch = _state(layer, device)
        found = _records[(layer, device, sparse)] = CallRecord(buf[_CALLS:_SPARSE + 1], scratch, 1.0 if sparse else 0.0)
    return found


def record_l1(layer: int, l1: torch.Tensor) -> None:
    """Store a measured L1 value (a device scalar) for ``layer``."""
    buffer(layer, l1.device)[_L1].copy_(l1.detach())


# Dead neurons: a neuron is dead when it has not fired in the last DEAD_WINDOW_TOKENS tokens of the
# calls that sample it (training calls that measure L1: every few eager calls, and every call a
# CUDA graph records, so replays keep sampling). 2^18 tokens is 16 samples of a 16384-token step.
DEAD_WINDOW_TOKENS = 1 << 18
# (layer, device) -> (float64 [H]: the sampled-token count at each neuron's last firing, float64 0-d: tokens sampled)
_fired: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def fired_state(layer: int, device, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's dead-neuron state (float64 ``[H]`` last firing, float64 0-d tokens sampled),
    made now, for compiled code that updates it itself."""
    key = (layer, device_key(device))
    state = _fired.get(key)
    if state is None or state[0].numel() != hidden:
        with _lock, torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.inference_mode(False):
            state = _fired[key] = (torch.zeros(hidden, dtype=torch.float64, device=device),
                                   torch.zeros((), dtype=torch.float64, device=device))
            if state[0].is_cuda and not torch.cuda.is_current_stream_capturing():
                warm_stamp_fired(device)  # the sampled calls' kernel, compiled before any capture records one
    return state


def record_fired(layer: int, fired: torch.Tensor, tokens: int) -> None:
    """Record which of the layer's neurons fired (bool ``[H]``) in a sampled call of ``tokens``
    tokens: two small device ops, no host sync (CUDA graphs replay them)."""
    last, seen = fired_state(layer, fired.device, fired.numel())
    seen.add_(float(tokens))
    torch.where(fired, seen, last, out=last)


def record_fired_packed(layer: int, packed: TwellPacked, hidden: int, tokens: int) -> None:
    """``record_fired`` for the neurons a sampled call's TwELL buffer holds
    (``reference.fired_neurons``): on CUDA one kernel stamps them (``stamp_fired``), after a
    device add to the tokens sampled; no host sync."""
    if not packed.count.is_cuda:
        record_fired(layer, reference.fired_neurons(packed, hidden), tokens)
        return
    last, seen = fired_state(layer, packed.count.device, hidden)
    seen.add_(float(tokens))
    stamp_fired(packed, last, seen.view(1))


def dead_share(layer: int) -> Optional[float]:
    """The share of the layer's neurons with no firing in the last ``DEAD_WINDOW_TOKENS`` sampled
    tokens; None until that many tokens were sampled. Synchronises (``stats()`` only)."""
    found = [v for (lid, _), v in list(_fired.items()) if lid == layer]
    if not found:
        return None
    last, seen = found[0]
    if float(seen) < DEAD_WINDOW_TOKENS:
        return None
    return float((seen - last > DEAD_WINDOW_TOKENS).double().mean())


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
        _by_caller.clear()
        _records.clear()
        _fired.clear()
