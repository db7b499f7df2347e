"""Eager calls replayed from CUDA graphs: the ops' launches without their host time.

An eager sparse inference call launches six Triton kernels and allocates about ten tensors, a
training step some twenty of each. On an H100 host that is 0.4-0.7 ms of host time for an
inference call and 2.2-2.9 ms for a training step, against ~75 µs of GPU work for the inference
call at 512 tokens of the 2B FFN (docs/benchmarks.md): small calls, and every call of a small
model, are bound by their host. So once a layer has run a call of one shape on one path eagerly,
the next such call records its launches into a CUDA graph (``torch.cuda.CUDAGraph``), and later
calls copy their tokens into the graph's input and replay it: a copy and a graph launch of host
time.

* **Which calls**: CUDA calls outside any CUDA-graph capture, of at most ``REPLAY_MAX_WORK``
  tokens × D × H (beyond it the GPU work hides the host's and the copy would only add to it), for
  layers not compiled for CUDA graphs (those replay Inductor's graphs already) and whose weights
  are not gathered per call (FSDP2: new tensors every call). Inference calls on both paths,
  training calls on the sparse path: a dense training forward keeps three ``[tokens, H]``
  activations for its backward, which a graph would hold for good. ``TWELL_CALL_REPLAY=0`` turns
  replays off.
* **Exact**: a replay launches the binaries, configs and arguments its recorded call launched, on
  the copied tokens and the weights' current memory: bitwise the eager result.
* **Keys**: layer, device, path, mode, whether the call measures L1, the tokens' shape and dtype,
  inference mode, and what the graph reads besides the tokens: the weights (pointer, shape,
  dtype), the layer's telemetry buffers and, for inference, the cached per-weight tensors
  (``WeightPrep``) and the weights' in-place versions, so that an optimizer step records anew and
  drops the layer's older inference graphs. A training graph makes its per-weight tensors itself
  on every replay, as any capture does, so every step replays the same graph on new weights.
  A weight with no version counter (made under ``torch.inference_mode``) is never replayed.
* **Weights copied in**: once a layer's training call finds its weights elsewhere in memory than a
  kept training key's (autocast's copies are made anew every step, wherever the allocator puts
  them), that layer's training graphs read copies of the weights of their own, which each replay
  copies in, and their keys hold the weights' shape and dtype only: a read and a write of the
  weights per replay, about what autocast's cast itself costs, instead of a new key (an eager call)
  per step.
* **Training**: a recorded forward's result (the TwELL buffers, the per-weight tensors) is what its
  backward reads, with its own tokens and output gradient copied in. The backward finds its forward
  graph by the ``count`` buffer it receives: while the caller holds that buffer the forward graph
  cannot replay, so its result is still the one the count came from. Each forward graph has its own
  backward graphs (per host choice of the weight-gradient variant).
* **Outputs**: a graph's result is handed to the caller, and that graph is replayed only once
  nothing outside holds any of its storages (their use counts, the check Inductor's cudagraph trees
  make). Until then a call of the same key records another graph, up to ``GRAPHS_PER_KEY``; past
  that it runs eagerly. A caller that hands an output to another stream must ``record_stream`` it,
  as for any tensor of the caching allocator.
* **Bounded**: at most ``GRAPHS_PER_LAYER`` forward graphs per layer and device and
  ``GRAPHS_MAX`` in all, least recently used dropped first, and no new recording once the kept
  graphs hold ``MEMORY_SHARE`` of the device's memory. Each holds its input copy, its result and
  the call's intermediates in a memory pool of its own: graphs replay in any order, so their pools
  cannot be shared.

Each recording first runs the call once outside the capture, result dropped and counters
written to a scratch record, so that a kernel specialization never seen compiles there and not
inside the capture. A capture that fails (out of memory, an operation a capture forbids) warns
once and leaves its key to eager calls.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter, OrderedDict
from typing import Any, Callable, NamedTuple, Optional

import torch

from twell_compile.kernels import CallRecord

from . import weight_cache
from .weight_cache import state_key

_setting = os.environ.get("TWELL_CALL_REPLAY", "1")
if _setting not in ("0", "1"):
    raise ValueError(f"TWELL_CALL_REPLAY must be 0 or 1, got {_setting!r}")
ENABLED = _setting == "1"

# Above this many tokens × D × H a call's GPU work hides its host time, and the input copies would
# only add GPU time (a sparse inference call of 8192 tokens at D=2048, H=5632 takes ~0.65 ms of
# GPU time). It is the eager sparse limit, ``dispatch_policy.SPARSE_MIN_TOKENS`` (12288) tokens, at
# that shape, so that no call there falls between the two limits and stays dense: 90k tokens at
# D=768, H=2048.
REPLAY_MAX_WORK = 12288 * 2048 * 5632
GRAPHS_PER_KEY = 2
# Per layer: training graphs with and without the L1 value for two forwards held at once, and an
# inference graph or two.
GRAPHS_PER_LAYER = 6
GRAPHS_MAX = 128
# Recorded graphs hold at most about this share of the device's memory (what the caching
# allocator reserved while each was recorded); past it, calls with no graph yet run eagerly.
# The 2B FFN training at 8192 tokens takes ~0.5-1 GB a layer (forward and backward graphs).
MEMORY_SHARE = 0.1

Launches = Callable[..., Any]


def tensors_of(result) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple of results."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, tuple):
        return [t for part in result for t in tensors_of(part)]
    return []


def handed(result):
    """``result`` with each tensor replaced by a new alias of it (``detach``): what the caller
    gets, so that every reference it keeps counts as a use of the graph's storages."""
    if isinstance(result, torch.Tensor):
        return result.detach()
    if isinstance(result, tuple):
        parts = [handed(part) for part in result]
        return type(result)(*parts) if hasattr(result, "_fields") else tuple(parts)
    return result


class RecordedCall:
    """One CUDA graph of a call: the static inputs a call copies its values into, the result the
    graph writes (handed to the caller on each replay), and what it reads that must stay alive."""

    __slots__ = ("graph", "inputs", "result", "storages", "reads", "training", "weights", "backward", "bytes")

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: tuple, result, reads: tuple) -> None:
        self.graph, self.inputs, self.result = graph, inputs, result
        self.reads = reads  # kept alive: their ids and pointers are in the key
        # Per storage of the result: the uses it has when only this object holds it: one per
        # tensor of the result on it and per base such a view keeps alive, and the storage object.
        held: dict[int, tuple] = {}
        for t in tensors_of(result):
            storage = t.untyped_storage()
            storage, impls = held.setdefault(storage._cdata, (storage, set()))  # not data_ptr: 0 for empty ones
            impls.add(t._cdata)
            if t._base is not None:
                impls.add(t._base._cdata)
        self.storages = [(storage, len(impls) + 1) for storage, impls in held.values()]
        self.training = False  # a training forward, found by its backward through TRAINING_FORWARDS
        self.weights: Optional[tuple] = None  # a training forward's own copies of the weights, if it reads them
        self.bytes = 0  # what the allocator reserved while it was recorded (``held_bytes``)
        self.backward: "OrderedDict[tuple, KeyState]" = OrderedDict()  # a training forward's backward graphs

    def idle(self) -> bool:
        """Whether nothing outside holds the result (a replay would overwrite it)."""
        return all(torch._C._storage_Use_Count(s._cdata) == uses for s, uses in self.storages)

    def replay(self, *values: torch.Tensor) -> None:
        """Copy ``values`` into the graph's inputs (one launch for all) and replay it."""
        torch._foreach_copy_(list(self.inputs), list(values))
        self.graph.replay()

    def handed(self):
        """The result for the caller (new aliases). A training forward's per-weight tensors stay
        the graph's: its backward reads them from here, so no caller needs an alias of them."""
        if self.training:
            return handed(self.result[0]), None
        return handed(self.result)


class KeyState:
    """A key's eager calls, recorded graphs, and whether its capture failed."""

    __slots__ = ("eager_calls", "graphs", "failed")

    def __init__(self) -> None:
        self.eager_calls = 0
        self.graphs: list[RecordedCall] = []
        self.failed = False


# (layer, device index, path, training, L1 measured, shape, dtype, inference mode, reads) ->
# KeyState, least recently used first
KEYS: "OrderedDict[tuple, KeyState]" = OrderedDict()
# (layer, device index) whose training graphs copy the weights in (their weights moved)
COPIED_WEIGHTS: set = set()
# count pointer -> the recorded training forward whose result holds that count
TRAINING_FORWARDS: "dict[int, RecordedCall]" = {}
_side_streams: dict[int, torch.cuda.Stream] = {}
_warned: set = set()
# Bytes the kept graphs reserved when recorded (``MEMORY_SHARE``)
held_bytes = 0
# What happened to each eligible call, and to recorded graphs, by reason (``stats``): what a run
# that replays less than expected is read from.
OUTCOMES: Counter = Counter()
_device_bytes: dict[int, int] = {}


def has_room(device: torch.device) -> bool:
    """Whether the kept graphs hold less than ``MEMORY_SHARE`` of ``device``'s memory."""
    index = device.index or 0
    total = _device_bytes.get(index)
    if total is None:
        total = _device_bytes[index] = torch.cuda.get_device_properties(index).total_memory
    return held_bytes < MEMORY_SHARE * total


def eligible(x2d: torch.Tensor, hidden: int, layer: int, capturing: bool, keep: bool) -> bool:
    """Whether a call may be replayed: enabled, CUDA, at most ``REPLAY_MAX_WORK`` tokens × D × H,
    no capture underway, a layer that keeps per-weight state (not compiled for CUDA graphs) and
    whose weights are not gathered per call."""
    return (ENABLED and x2d.is_cuda and not capturing and keep and x2d.numel() * hidden <= REPLAY_MAX_WORK
            and layer not in weight_cache.GATHERED_WEIGHT_LAYERS)


def forward(layer: int, sparse: bool, training: bool, want_l1: bool, x2d: torch.Tensor, weights: tuple,
            record: CallRecord, launches: Launches, prep: Optional[tuple] = None):
    """``launches(x2d, record, weights)``'s result: replayed from a graph of the call's key,
    recorded now, or run eagerly. ``weights``: ``(wg, wu, wd, bg, bu, bd)``, None for absent ones;
    a graph that copies the weights in passes its own copies.

    Inference: ``prep`` is the cached per-weight tensors the launches read (``WeightPrep.get``),
    and the weights' in-place versions are in the key, so a changed weight (a new prep) records
    anew. Training: the launches make their own prep, as under any capture, so the key holds the
    weights' memory (pointer, shape, dtype), or only their shape and dtype where the layer's
    graphs copy them in, and not their versions, which every optimizer step bumps; the replays
    read the weights' current values."""
    where = (layer, x2d.device.index or 0)
    if training:
        key = _training_key(where, sparse, want_l1, x2d, weights, record)
        if key not in KEYS and where not in COPIED_WEIGHTS and _weights_moved(key):
            _copy_weights_in(where)
            key = _training_key(where, sparse, want_l1, x2d, weights, record)
    else:
        reads = tuple(None if w is None else state_key(w) for w in weights)
        if any(r is None for r, w in zip(reads, weights) if w is not None):
            OUTCOMES["forward eager: a weight without versions"] += 1
            return launches(x2d, record, weights)
        # What the graph reads besides the tokens: the weights, the prep and the record's buffers (kept
        # alive by the graph, so their ids and pointers stay theirs).
        key = (*where, sparse, False, want_l1, tuple(x2d.shape), x2d.dtype, torch.is_inference_mode_enabled(),
               (reads, id(prep), record.values.data_ptr(), record.scratch.data_ptr()))
    copied = training and where in COPIED_WEIGHTS
    values = (x2d, *(w for w in weights if w is not None)) if copied else (x2d,)
    state = KEYS.get(key)
    if state is None:
        if not training:
            _drop_stale(key)
        state = KEYS[key] = KeyState()
    else:
        KEYS.move_to_end(key)
    recorded = next((r for r in state.graphs if r.idle()), None)
    if recorded is not None:
        OUTCOMES["forward replayed"] += 1
        recorded.replay(*values)
    elif (reason := _eager_reason(state, x2d.device)) is not None:
        OUTCOMES[f"forward eager: {reason}"] += 1
        state.eager_calls += 1
        return launches(x2d, record, weights)
    else:
        # The launches on the graph's tokens and, where it copies them in, its weights.
        def run(x, *rest):
            return launches(x, rest[-1], _placed(weights, rest[:-1]) if copied else weights)

        recorded = _record(layer, state, values, run, (record,), (prep, record))
        if recorded is None:
            return launches(x2d, record, weights)
        if copied:
            recorded.weights = _placed(weights, recorded.inputs[1:])
        _evict(where)
        recorded.training = training
    if training:
        # Each should meet its backward here (``backward``'s outcomes): fewer backwards mean some
        # did not find their forward graph.
        OUTCOMES["training forwards from graphs"] += 1
        TRAINING_FORWARDS[recorded.result[0].packed.count.data_ptr()] = recorded
    return recorded.handed()


def _training_key(where: tuple, sparse: bool, want_l1: bool, x2d: torch.Tensor, weights: tuple,
                  record: CallRecord) -> tuple:
    """A training call's key: the weights' memory, shape and dtype (memory left out where the
    layer's graphs copy them in) and the record's buffers."""
    copied = where in COPIED_WEIGHTS
    reads = tuple(None if w is None else (None if copied else w.data_ptr(), tuple(w.shape), w.dtype) for w in weights)
    return (*where, sparse, True, want_l1, tuple(x2d.shape), x2d.dtype, torch.is_inference_mode_enabled(),
            (reads, None, record.values.data_ptr(), record.scratch.data_ptr()))


def _placed(weights: tuple, copies) -> tuple:
    """``weights`` with its present tensors replaced, in order, by ``copies``."""
    copies = iter(copies)
    return tuple(None if w is None else next(copies) for w in weights)


def _weights_moved(key: tuple) -> bool:
    """Whether the layer keeps a training key for the same weights' shapes elsewhere in memory."""
    def shapes(k):
        return [r if r is None else r[1:] for r in k[-1][0]]

    return any(k[:2] == key[:2] and k[3] and k[-1][0] != key[-1][0] and shapes(k) == shapes(key) for k in KEYS)


def _copy_weights_in(where: tuple) -> None:
    """From now on ``where``'s training graphs copy the weights in: its training keys for weights
    at fixed memory go, with their graphs."""
    COPIED_WEIGHTS.add(where)
    OUTCOMES["layers whose training graphs copy the weights in"] += 1
    for k in [k for k in KEYS if k[:2] == where and k[3]]:
        _clear(KEYS.pop(k))


def training_forward(count: torch.Tensor, x2d: torch.Tensor) -> Optional[RecordedCall]:
    """The recorded training forward whose result holds ``count`` (for tokens of ``x2d``'s shape
    and dtype), or None: then the backward runs eagerly. Its result is the one this ``count``
    came from: while the caller holds ``count`` that graph cannot replay again."""
    recorded = TRAINING_FORWARDS.get(count.data_ptr())
    if recorded is not None and recorded.result[0].packed.count.shape == count.shape:
        x_graph = recorded.inputs[0]
        if (x_graph.shape, x_graph.dtype) == (x2d.shape, x2d.dtype):
            return recorded
    return None


def backward(fwd: RecordedCall, key: tuple, dout2d: torch.Tensor, x2d: torch.Tensor, l1_scale: torch.Tensor,
             launches: Launches):
    """The gradients of a replayed training forward ``fwd``: ``launches(dout2d, x2d, l1_scale)``,
    which reads the forward graph's result, replayed from a graph of ``fwd`` and ``key`` (the host's
    choices), recorded now (after a warm-up run), or run eagerly. The tokens are the backward's
    own (``x2d``, copied in): under ``torch.compile`` they may be recomputed rather than saved."""
    state = fwd.backward.get(key)
    if state is None:
        state = fwd.backward[key] = KeyState()
        state.eager_calls = 1  # the forward's kernels are tuned; the warm-up compiles the rest
    values = (dout2d, x2d, l1_scale)
    recorded = next((r for r in state.graphs if r.idle()), None)
    if recorded is not None:
        OUTCOMES["backward replayed"] += 1
        recorded.replay(*values)
        return recorded.handed()
    if (reason := _eager_reason(state, x2d.device)) is not None:
        OUTCOMES[f"backward eager: {reason}"] += 1
        return launches(*values)
    recorded = _record(-1, state, values, launches, (), ())
    return launches(*values) if recorded is None else recorded.handed()


def _eager_reason(state: KeyState, device: torch.device) -> Optional[str]:
    """Why a call of ``state``'s key with no idle graph runs eagerly, or None: it records one."""
    if state.failed:
        return "its capture failed"
    if state.eager_calls == 0:
        return "first call of its key"
    if len(state.graphs) >= GRAPHS_PER_KEY:
        return "its graphs' results still held"
    if not has_room(device):
        return "memory share spent"
    return None


def _drop_stale(key: tuple) -> None:
    """For a new inference key: drop the layer's inference keys for other weights (older versions,
    other tensors, another prep) or another call record (telemetry was reset), which will not come
    back."""
    for old in [k for k in KEYS if k[:2] == key[:2] and not k[3] and k[-1] != key[-1]]:
        OUTCOMES["inference keys dropped: weights changed"] += 1
        _clear(KEYS.pop(old))


def _clear(state: KeyState) -> None:
    """Drop a key's graphs (and a training forward's backward graphs) and their held bytes."""
    global held_bytes
    for recorded in state.graphs:
        held_bytes -= recorded.bytes
        if recorded.training:
            TRAINING_FORWARDS.pop(recorded.result[0].packed.count.data_ptr(), None)
        for backward_state in recorded.backward.values():
            _clear(backward_state)
    state.graphs.clear()


def _evict(layer: tuple) -> None:
    """Keep at most ``GRAPHS_PER_LAYER`` graphs in ``layer`` (layer, device) and ``GRAPHS_MAX`` in
    all, dropping the least recently used keys' graphs first. A dropped graph's output, if still
    held, stays valid: the tensor keeps its memory."""
    in_layer = sum(len(s.graphs) for k, s in KEYS.items() if k[:2] == layer)
    total = sum(len(s.graphs) for s in KEYS.values())
    for k, state in list(KEYS.items()):
        if in_layer <= GRAPHS_PER_LAYER and total <= GRAPHS_MAX:
            return
        if not state.graphs or (total <= GRAPHS_MAX and k[:2] != layer):
            continue
        if k[:2] == layer:
            in_layer -= len(state.graphs)
        total -= len(state.graphs)
        OUTCOMES["keys evicted by the graph bounds"] += 1
        _clear(state)


def _record(layer: int, state: KeyState, values: tuple, launches: Launches, extra: tuple,
            reads: tuple) -> Optional[RecordedCall]:
    """Record a graph of ``launches(*static copies of values, *extra)`` (after a warm-up run
    outside the capture, whose result is dropped and whose call record is a scratch one), replay it
    for this call, and keep it; on failure warn once and return None (the caller runs eagerly)."""
    global held_bytes
    direction = "forward" if layer >= 0 else "backward"
    device = values[0].device
    reserved = torch.cuda.memory_reserved(device)
    current = torch.cuda.current_stream(device)
    side = _side_streams.get(device.index or 0)
    if side is None:
        side = _side_streams[device.index or 0] = torch.cuda.Stream(device)
    try:
        inputs = tuple(torch.empty_like(v) for v in values)
        for static, value in zip(inputs, values):
            static.copy_(value)
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            launches(*inputs, *(_scratch(e) for e in extra))  # warm-up: compiles any specialization not seen yet
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                result = launches(*inputs, *extra)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        recorded = RecordedCall(graph, inputs, result, reads)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        state.failed = True
        OUTCOMES[f"{direction} captures failed"] += 1
        if layer not in _warned:
            _warned.add(layer)
            where = f"layer {layer}" if layer >= 0 else "a backward"
            warnings.warn(f"twell: {where}: its calls cannot be replayed from a CUDA graph ({exc}); they run "
                          "eagerly (exact, with their host time)", RuntimeWarning, stacklevel=4)
        current.wait_stream(side)
        return None
    OUTCOMES[f"{direction} recorded"] += 1
    recorded.bytes = max(0, torch.cuda.memory_reserved(device) - reserved)
    held_bytes += recorded.bytes
    state.graphs.append(recorded)
    graph.replay()
    return recorded


def _scratch(record: CallRecord) -> CallRecord:
    """A call record of the same flag in fresh buffers: the warm-up's, which no counter sees."""
    device = record.values.device
    return CallRecord(torch.zeros(5, dtype=torch.float64, device=device),
                      torch.zeros(3, dtype=torch.int64, device=device), record.flag)


class ReplayStats(NamedTuple):
    recorded: int  # graphs recorded so far
    kept: int  # graphs kept now
    held_bytes: int  # what the kept graphs reserved when recorded
    outcomes: dict  # calls and graphs by what happened to them (``OUTCOMES``)


def stats() -> ReplayStats:
    """The recorded graphs, and what happened to the calls that could have been replayed."""
    kept = sum(1 + sum(len(b.graphs) for b in r.backward.values()) for s in KEYS.values() for r in s.graphs)
    recorded = OUTCOMES["forward recorded"] + OUTCOMES["backward recorded"]
    return ReplayStats(recorded, kept, held_bytes, dict(OUTCOMES))


# Calls that do once-only work: a key's first call (run eagerly so that the next one records), a
# recording, a capture that failed.
_WARM_UPS = ("forward eager: first call of its key", "forward recorded", "backward recorded",
             "forward captures failed", "backward captures failed")


def warm_ups() -> int:
    """How many calls so far did once-only work (``measure.first_launches`` counts them: a step
    with such a call is slower than the replays after it, so a step-time measurement over it is
    taken again)."""
    return sum(OUTCOMES[k] for k in _WARM_UPS)


class replays_off:  # noqa: N801 - a context manager, named like torch.no_grad
    """``with replays_off():`` every call inside runs its launches eagerly (and records nothing);
    the previous setting is back on exit. For measuring what an eager call allocates: a replayed
    call allocates nothing, as its graph holds its buffers for good."""

    def __enter__(self) -> "replays_off":
        global ENABLED
        self._before, ENABLED = ENABLED, False
        return self

    def __exit__(self, *exc) -> None:
        global ENABLED
        ENABLED = self._before


def clear() -> None:
    """Drop every recorded graph (tests; freeing their memory)."""
    global held_bytes
    KEYS.clear()
    TRAINING_FORWARDS.clear()
    COPIED_WEIGHTS.clear()
    OUTCOMES.clear()
    held_bytes = 0
