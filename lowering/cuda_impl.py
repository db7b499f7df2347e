"""CUDA implementations of the TwELL ops: Triton kernels, with a per-layer dense/sparse dispatch.

Each layer picks its path from its **previous** call's counters, copied to pinned host memory
asynchronously and read only once the copy's event has completed (``event.query()``), so the hot
path never synchronises the host:

* **sparse**: ``gate_pack`` (the gate GEMM packs TwELL in its epilogue), then ``sparse_ffn`` (up
  and down for the active neurons only) and, in training, ``sparse_ffn_backward``;
* **dense**: cuBLAS through PyTorch, exactly the dense FFN. A layer starts dense (early in
  training a ReLU FFN is ~50% dense) and turns sparse once its measured density drops below
  ``SPARSE_MAX_DENSITY`` (per mode; set from ``twell bench`` on the H200) on calls of at least
  ``SPARSE_MIN_TOKENS`` tokens. In training the dense path keeps ``relu(gate)``, ``up`` and ``h``
  for its backward, as dense autograd does.

Both paths compute the same function for every input (DESIGN.md section 5): the choice costs or
saves time, never correctness. Under CUDA-graph capture the path chosen at capture is the one
recorded and replayed (host-side decisions cannot run inside a graph replay): sparse from
``SPARSE_MIN_TOKENS_CAPTURED`` tokens (below ``SPARSE_FULL_TOKENS_CAPTURED`` tokens only at a
density under ``SPARSE_MAX_DENSITY_FEW_TOKENS``) when the layer's density was known before the capture and
its problem's kernels were tuned outside it (``_WARM``). Layers compiled for CUDA graphs see to
both on their eager warm-up call (``_prepare_capture``).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F

from twell_compile.kernels import reference
from twell_compile.kernels.format import DEFAULT_LAYOUT, TwellPacked

from . import telemetry

# Below these fractions of active gate units the sparse path is taken: the crossovers measured on
# the H200 (bf16, D=2048, H=5632, M=16384, docs/benchmarks.md, session 8), forced sparse against
# dense eager, uniform / skewed neurons. Inference: 1.20x / 1.24x at 0.6%, 1.10x / 1.16x at 0.7%,
# 1.05x / 1.09x at 0.8%, 1.01x / 1.11x at 0.9%, 0.96x at 1%, against 0.91-0.99x for the dense path
# (0.97-1.06x since session 11's fused activation). Training: 1.26x / 1.09x at 0.6%, 1.13x / 1.00x
# at 0.7%, 1.06x / 0.92x at 0.8%, against 1.01-1.03x for the dense path; since session 11's fused
# passes the dense path is 1.12-1.14x, and forced sparse measured 1.20x / 1.07x at 0.7%. Since
# session 25's weight-gradient kernel (the hottest neurons split over programs), sparse training
# at 1% runs 1.31x / 1.30x of dense in CUDA graphs and 1.22x / 1.21x eager on a slow host, against
# the dense path's 1.13x, crossing it near 1.2% / 1.15% (~1.1% eager), and 0.72x at 2%. Session 26,
# with the bench's host running ahead (as in a model), inference forced sparse ran 1.20x / 1.23x at
# 0.8%, 1.14x / 1.17x at 0.9%, 1.08x / 1.09x at 1.0%, 1.04x / 1.05x at 1.1% and 0.97x / 1.00x at
# 1.2%, against 1.03-1.04x for the dense path. Each threshold sits at or below the skewed
# crossover, with the heavy rows of real models in mind.
SPARSE_MAX_DENSITY = {"inference": 0.0105, "training": 0.0105}
# Below this many tokens per call the sparse path is bound by its host time (~1.0 ms per call on
# the H200's host in session 4: op dispatch, Triton launches, guard and telemetry ops), which dense cuBLAS
# at D=2048, H=5632 undercuts below ~9.4k tokens (M=4096: sparse 1.40 ms, dense 0.44 ms).
SPARSE_MIN_TOKENS = 12288
# Inside a CUDA graph there is no host time to pay, so the sparse path beats dense from fewer
# tokens. Session 31 (H200, every provider captured, forced sparse against dense, uniform neurons;
# docs/benchmarks.md): inference 1.12x / 1.19-1.26x at 0.5% for 3072 / 4096 tokens, 1.04x / 1.05x
# at 0.8% and 0.93x / 0.94x at 1.05%, 1.15x / 1.02x at 8192 tokens and 0.8% / 1.05%, 0.98x at 2048
# tokens and 0.5% (the op's dense path: 1.02x); a training step 1.65x / 1.72x at 0.5%, 1.29x / 1.35x
# at 0.8%, 1.11x / 1.16x at 1.05% (the dense path: 1.16-1.21x). So a capture records the sparse
# path from SPARSE_MIN_TOKENS_CAPTURED tokens, below SPARSE_MAX_DENSITY_FEW_TOKENS until
# SPARSE_FULL_TOKENS_CAPTURED tokens and below SPARSE_MAX_DENSITY from there.
SPARSE_MIN_TOKENS_CAPTURED = 3072
SPARSE_FULL_TOKENS_CAPTURED = 8192
SPARSE_MAX_DENSITY_FEW_TOKENS = 0.007
# Above these fractions of rows computed densely (overflow, guard) the dense path is faster. On the
# H200 at M=16384, 0.5% density (docs/benchmarks.md, session 15), each such row added ~0.7 us to
# an inference call (1.29 -> 1.47 ms with 256 rows, 1.6%; dense 1.70) and ~2.7 us to a training
# step (3.96 -> 4.66 ms with 256 rows; the dense path 5.0; ~11 us before the backward summed their
# weight gradients as GEMMs). Neither may exceed kernels.dense_rows.DENSE_ROW_FRACTION_MAX, the
# rows the kernels' scratch holds (rows past it are slow).
SPARSE_MAX_DENSE_ROWS = {"inference": 0.02, "training": 0.015}
# The same for a layer recorded in a CUDA graph, which replays its path for good. On the H200 the
# 2B Llama under mode="reduce-overhead" at 0.5% density ran 1.12x Inductor's graphs with 1.1 such
# rows per layer in 16384 tokens (0.007%, session 14). With 46.6 in 8192 (0.57%) every layer
# sparse ran 0.99x, and 1.01x with this limit, which kept 36 of 38 layers dense (session 15).
SPARSE_MAX_DENSE_ROWS_CAPTURED = 0.001
# The training L1 value for stats() costs a reduction and a copy (two launches of host time): measure
# it every N eager calls, and on every call a CUDA graph records (a graph replays what its capture
# did, so one captured on a call that skipped it would never report L1).
L1_EVERY = 8


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    return torch.cuda.is_available()  # an NVML/environment check: ~2 µs, 4+ times per call


def _capturing() -> bool:
    return _cuda_available() and torch.cuda.is_current_stream_capturing()


# Benchmarks set this to "sparse" or "dense" to time one path whatever the policy would choose.
FORCE_PATH: Optional[str] = None


class _LayerPolicy:
    """Per (layer, device): the path to take, from the last completed counters copy."""

    def __init__(self) -> None:
        self.host = torch.zeros(len(telemetry.FIELDS), dtype=torch.float64, pin_memory=True)
        self.event: Optional[torch.cuda.Event] = None
        self.density = 1.0  # unknown until the first call's counters arrive: start dense
        self.dense_row_fraction = 1.0
        self.measured = False  # whether counters have arrived yet
        self.calls = 0

    def refresh(self) -> None:
        """Take the last counters copy in, if it has completed (no sync)."""
        if self.event is not None and not _capturing() and self.event.query():
            v = dict(zip(telemetry.FIELDS, self.host.tolist()))  # completed copy: no sync
            tokens = max(1.0, v["tokens"])
            self.density = v["active"] / tokens / max(1.0, self._hidden)
            self.dense_row_fraction = v["dense_rows"] / tokens
            self.event = None
            self.measured = True

    def expects_dense_rows(self, tokens: int, rows: int) -> bool:
        """Whether a call of ``tokens`` tokens should expect ``rows`` or more dense rows, from the
        last measured call (False until one is)."""
        self.refresh()
        return self.measured and self.dense_row_fraction * tokens >= rows

    def choose(self, training: bool) -> bool:
        """Whether the last measured call's density and dense rows favour the sparse path."""
        self.refresh()
        mode = "training" if training else "inference"
        return self.density < SPARSE_MAX_DENSITY[mode] and self.dense_row_fraction < SPARSE_MAX_DENSE_ROWS[mode]

    def choose_captured(self, training: bool, tokens: int) -> bool:
        """The same for a call of ``tokens`` tokens that a CUDA graph records, which replays its
        path for good: sparse from ``SPARSE_MIN_TOKENS_CAPTURED`` tokens, under a stricter limit
        on the rows computed densely, and a lower density limit below
        ``SPARSE_FULL_TOKENS_CAPTURED`` tokens."""
        self.refresh()
        if tokens < SPARSE_MIN_TOKENS_CAPTURED:
            return False
        limit = SPARSE_MAX_DENSITY["training" if training else "inference"]
        if tokens < SPARSE_FULL_TOKENS_CAPTURED:
            limit = min(limit, SPARSE_MAX_DENSITY_FEW_TOKENS)
        return self.density < limit and self.dense_row_fraction < SPARSE_MAX_DENSE_ROWS_CAPTURED

    def settle(self) -> None:
        """Wait for the pending counters copy: a host sync, for CUDA-graph warm-ups only."""
        if self.event is not None:
            self.event.synchronize()

    def after(self, buf: torch.Tensor, hidden: int) -> None:
        self.calls += 1
        self._hidden = hidden
        if self.event is None and not _capturing():
            self.host.copy_(buf, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    _hidden = 1


_policies: dict[tuple[int, int], _LayerPolicy] = {}
_lock = threading.Lock()


def _policy(layer: int, device: torch.device, *, create: bool = True) -> Optional[_LayerPolicy]:
    """The layer's policy on ``device``; with ``create=False`` None if it has none yet (a
    backward must not create policy state, which would also need pinned memory)."""
    key = (layer, device.index or 0)
    p = _policies.get(key)
    if p is None and create:
        with _lock, torch.inference_mode(False):  # its pinned copy is updated in place on later calls
            p = _policies.setdefault(key, _LayerPolicy())
    return p


# The backward must know which path its forward took. Exactness never depends on this registry:
# a dense forward marks every tile as overflowed, which the sparse backward computes densely.
# Keys are the forward's ``count`` pointer: ``count`` is saved for backward, so no other forward
# can reuse that memory before this one's backward runs, and every training forward overwrites
# its key (a stale entry can never be read).
_DENSE_FORWARDS: "OrderedDict[int, bool]" = OrderedDict()
_DENSE_FORWARDS_MAX = 4096
# A training forward's hand-off to its backward, which then skips redoing the work:
# * a dense forward's relu(gate), up and h (what dense autograd saves): two GEMMs;
# * a sparse forward's per-weight prep (``_WeightPrep``), under CUDA-graph capture only, where
#   nothing is cached per weight (eagerly the cache serves the backward): one launch.
# Popped by the backward (``_take_saved``); bounded, and an evicted or missing entry only means
# redoing it (exact). Not kept for layers compiled for CUDA graphs (below), nor under saved-tensor
# hooks (activation checkpointing, offloading), which exist to control what is saved. Values:
# (tensors, whether the forward was dense, whether a CUDA-graph capture recorded them).
_HANDOFF: "OrderedDict[int, tuple[tuple, bool, bool]]" = OrderedDict()
_HANDOFF_MAX = 64


# Layers compiled to run under CUDA graphs (Inductor's cudagraph trees, e.g. mode="reduce-overhead"),
# set by the backend at compile time. Their warm-up runs eagerly in the graphs' memory pool, where
# a tensor kept after the op returns, such as the hand-off above, is an error ("tensors in the
# cudagraph pool not tracked as outputs"), so they keep nothing there.
_CUDA_GRAPH_LAYERS: set = set()


def mark_cuda_graph_layers(layers) -> None:
    """Layers whose graph Inductor will run under CUDA graphs (called by the backend)."""
    _CUDA_GRAPH_LAYERS.update(layers)


def _remember(count: torch.Tensor, dense: bool, saved: Optional[tuple] = None, layer: Optional[int] = None) -> None:
    key = count.data_ptr()
    _DENSE_FORWARDS[key] = dense
    _DENSE_FORWARDS.move_to_end(key)
    while len(_DENSE_FORWARDS) > _DENSE_FORWARDS_MAX:
        _DENSE_FORWARDS.popitem(last=False)
    _HANDOFF.pop(key, None)
    if saved is not None and layer not in _CUDA_GRAPH_LAYERS and not _saved_tensor_hooks_active():
        _HANDOFF[key] = (saved, dense, _capturing())
        while len(_HANDOFF) > _HANDOFF_MAX:
            _HANDOFF.popitem(last=False)


def _take_saved(key: int, *, dense: bool) -> Optional[tuple]:
    """A forward's hand-off, popped; None if there is none to use. A backward being captured takes
    only what a capture recorded (in a graph's memory pool, rewritten by each replay): an eager
    forward's tensors would be freed after this use while the graph kept reading their memory on
    every replay. ``dense``: the path the backward takes, which must be the forward's."""
    entry = _HANDOFF.pop(key, None)
    if entry is None or entry[1] != dense or (_capturing() and not entry[2]):
        return None
    return entry[0]


def _saved_tensor_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True  # cannot tell: keep nothing
    return top(False) is not None


# Problems whose sparse kernels have run outside capture, so are tuned and compiled ("warm"): a
# capture takes the sparse path only for those, since autotuning cannot run inside a capture. Keys:
# ("forward" | "backward", *_signature(...)); the kernels' tuning keys never depend on the token count.
_WARM: set = set()


def _signature(x2d, wg, wu, bg, bu, bd, training: bool) -> tuple:
    return (x2d.device, x2d.dtype, x2d.shape[1], wu.shape[0], wg is not None,
            *(None if b is None else b.dtype for b in (bg, bu, bd)), training)


def _warm(signature: tuple) -> bool:
    training = signature[-1]
    return ("forward", *signature) in _WARM and (not training or ("backward", *signature) in _WARM)


def _takes_sparse(policy: "_LayerPolicy", tokens: int, signature: tuple, training: bool, capturing: bool) -> bool:
    """Whether a call of ``tokens`` tokens takes the sparse path. In a capture: as
    ``choose_captured`` says, once the problem is warm. Outside: as ``choose`` says, from
    ``SPARSE_MIN_TOKENS`` tokens; and a call that a capture would send sparse goes sparse while its
    problem is cold, once, so that its kernels are tuned before any capture."""
    if capturing:
        return policy.choose_captured(training, tokens) and _warm(signature)
    if tokens >= SPARSE_MIN_TOKENS:
        return policy.choose(training)
    if _warm(signature):
        # Dense by its token count alone, but the layer's counters are still taken in: a later
        # capture, which cannot read them, must find its density measured.
        policy.refresh()
        return False
    return policy.choose_captured(training, tokens)


def forward(x2d, wg, wu, wd, bg, bu, bd, *, layer: int, training: bool):
    """Returns ``(ForwardResult, sparse: bool)`` and records the layer's counters.

    On the dense path the result's ``packed``/``up_val`` are None for inference and ``dense_rows``
    is None; the telemetry then counts the rows that would have overflowed a TwELL tile. On the
    sparse path too ``dense_rows`` is None (the counts mark them as overflowed).
    Either path's counting kernel stores the call's record in the layer's telemetry itself.
    """
    policy = _policy(layer, x2d.device)
    capturing = _capturing()
    signature = _signature(x2d, wg, wu, bg, bu, bd, training)
    if FORCE_PATH is None:
        sparse = _takes_sparse(policy, x2d.shape[0], signature, training, capturing)
    else:
        sparse = FORCE_PATH == "sparse"
    sparse = sparse and x2d.dtype != torch.float64
    want_l1 = training and (capturing or policy.calls % L1_EVERY == 0)
    saved = None
    keep = layer not in _CUDA_GRAPH_LAYERS
    record = telemetry.call_record(layer, x2d.device, sparse)
    if sparse:
        prep = _WeightPrep.get(wg, wu, wd, bg, bu, bd, keep=keep)
        res = _sparse_forward(x2d, wg, wu, wd, bg, bu, bd, training, want_l1, record, keep=keep, prep=prep)
        if capturing:
            saved = prep  # the captured backward's, as nothing is cached under capture
        else:
            _WARM.add(("forward", *signature))
    else:
        res, saved = _dense_forward(x2d, wg, wu, wd, bg, bu, bd, training, want_l1, record)
    if training:
        _remember(res.packed.count, not sparse, saved, layer)
    if res.l1 is not None:
        telemetry.record_l1(layer, res.l1)
    policy.after(telemetry.buffer(layer, x2d.device), wu.shape[0])
    if not keep and not capturing and FORCE_PATH is None and x2d.dtype != torch.float64:
        _prepare_capture(policy, x2d, wg, wu, wd, bg, bu, bd, sparse, training, signature, layer)
    return res, sparse


def _prepare_capture(policy, x2d, wg, wu, wd, bg, bu, bd, sparse: bool, training: bool, signature: tuple,
                     layer: int) -> None:
    """Prepare a layer compiled for CUDA graphs to record the sparse path.

    Inductor's cudagraph trees warm each graph up with one eager call, then record it. A layer's
    density is known only one call late, and autotuning cannot run inside a capture, so the
    recording would take the dense path. So on such a call (outside capture):

    * the layer's first counters are waited for (a host sync, on its first call only), so that
      the capture knows its density;
    * if the policy then picks sparse for a capture (``SPARSE_MAX_DENSE_ROWS_CAPTURED``) for a
      problem whose sparse kernels never ran, they run once
      on the same inputs (forward and, in training, backward with a zero ``dout``), results and
      counters discarded; the call's own result is the one already computed.
    """
    from twell_compile.kernels.dense_rows import CallRecord

    if not policy.measured:
        policy.settle()
    picks_sparse = policy.choose_captured(training, x2d.shape[0])  # reads the counters now, while not capturing
    if sparse or not picks_sparse or _warm(signature):
        return
    dev = x2d.device
    try:
        scratch = CallRecord(torch.zeros(5, dtype=torch.float64, device=dev), torch.zeros(3, dtype=torch.int64, device=dev), 1.0)
        res = _sparse_forward(x2d, wg, wu, wd, bg, bu, bd, training, False, scratch, keep=False)
        _WARM.add(("forward", *signature))
        if training:
            _remember(res.packed.count, False)
            zero = torch.zeros((), dtype=torch.float32, device=dev)
            backward(torch.zeros_like(res.out), x2d, wg, wu, wd, bg, bu, bd, res.packed, res.up_val, zero, layer=layer)
    except torch.cuda.OutOfMemoryError:
        # The call's own result is already computed: losing the tuning only costs speed.
        warnings.warn(f"twell: layer {layer}: not enough GPU memory to tune its sparse kernels before CUDA-graph "
                      "capture; it records the dense path", RuntimeWarning, stacklevel=2)


def _dense_forward(x2d, wg, wu, wd, bg, bu, bd, training: bool, want_l1: bool, record=None):
    """The dense FFN in the input dtype (exactly what the rewrite replaced), with ``relu(gate) · up``
    in one pass (``dense_act.dense_activation``) that stores the call's ``record`` (telemetry's
    ``call_record``): its active entries and the rows that would overflow a TwELL tile.

    Returns the result and, in training, ``(act, up, h)`` for the backward: what dense autograd
    saves.
    """
    from twell_compile.kernels.dense_act import dense_activation

    up = F.linear(x2d, wu, bu)
    pre = up if wg is None else F.linear(x2d, wg, bg)
    m, hidden = pre.shape
    n_tiles, slots = DEFAULT_LAYOUT.n_tiles(hidden), DEFAULT_LAYOUT.slots
    dev = x2d.device
    l1_sum = torch.zeros(1, dtype=torch.float32, device=dev) if want_l1 else None
    h, act = dense_activation(pre, None if wg is None else up, store_act=training, record=record, l1=l1_sum)
    del pre  # gated: dense autograd keeps relu(gate), not gate
    out = F.linear(h, wd, bd)
    if training:
        # TwELL buffers of the right shapes with every tile marked overflowed: the backward then
        # treats every row as dense, so even one that does not know this forward was dense is
        # exact. Slots are never read (dense rows skip their pairs), so they stay uninitialised.
        packed = TwellPacked(
            idx=torch.empty(m, n_tiles, slots, dtype=torch.int32, device=dev),
            val=torch.empty(m, n_tiles, slots, dtype=torch.float32, device=dev),
            count=torch.full((m, n_tiles), slots + 1, dtype=torch.int32, device=dev),
        )
        up_val = torch.empty(packed.val.shape if wg is not None else (0,), dtype=torch.float32, device=dev)
    else:
        packed, up_val = None, None
    l1 = l1_sum[0] / max(1, m) if want_l1 else None
    saved = (act, up, h) if training else None
    return reference.ForwardResult(out, packed, up_val, None, l1), saved


def _state_key(t: torch.Tensor) -> Optional[tuple]:
    """What identifies a weight's contents between calls: its in-place version counter, storage
    pointer, shape and dtype (an optimizer step bumps the version). None for inference-mode
    tensors, which have no version counter: never cache on them."""
    try:
        return (t._version, t.data_ptr(), tuple(t.shape), t.dtype)
    except RuntimeError:
        return None


def _sparse_forward(x2d, wg, wu, wd, bg, bu, bd, training: bool, want_l1: bool,
                    record=None, *, keep: bool = True, prep: Optional[tuple] = None) -> reference.ForwardResult:
    """The sparse path. ``record`` (telemetry's ``call_record``) receives the active entries and
    the rows computed densely. In training the pair loop also sums each row's ``|h|``
    (``sparse_ffn``'s ``l1_rows``), over the rows it computes, and ``want_l1`` sums those into the
    L1 value. ``dense_rows`` of the result is None. ``keep=False``: cache nothing per weight
    (``_WeightPrep``): layers compiled for CUDA graphs. ``prep``: ``_WeightPrep.get``'s, if the
    caller has it."""
    from twell_compile.kernels.gate_pack import gate_pack
    from twell_compile.kernels.sparse_ffn import sparse_ffn

    gated = wg is not None
    # Inference keeps the TwELL buffer inside the op and reads it as 8-byte (idx, val) slots;
    # training returns idx and val from twell::ffn_train, whose schema has them as two contiguous
    # tensors.
    paired = not training
    packed = gate_pack(x2d, wg, bg, paired=paired) if gated else gate_pack(x2d, wu, bu, paired=paired)
    if prep is None:
        prep = _WeightPrep.get(wg, wu, wd, bg, bu, bd, keep=keep)  # once: uncached, it is a launch
    forward_bound, _, wd_rows = prep
    # The finiteness guard (kernels/reference.py, "Exactness guard"), in the pair loop's kernel from
    # the x rows it loads anyway: a non-finite row has a non-finite norm, and for gated FFNs
    # ‖x_t‖·max‖Wu_j‖ + max|bu| bounds the up projection (a huge finite row is flagged too, which
    # only costs speed). It marks the rows it sends dense in the counts, where the backward finds
    # them, and stores the call's record.
    rows = dict(wg=wg, bg=bg, guard_bound=forward_bound, record=record, mark=True)
    l1 = None
    if training:  # the backward needs the up values at the stored pairs
        # Every training call stores the L1 shares (one kernel variant, so none is first compiled
        # inside a CUDA-graph capture); only the calls that measure L1 sum them.
        l1_rows = torch.empty(x2d.shape[0], dtype=torch.float32, device=x2d.device)
        out, up_val = sparse_ffn(x2d, packed, wu, wd_rows, bu, bd, **rows, return_up=True, reuse_tickets=keep,
                                 l1_rows=l1_rows)
        if want_l1:
            l1 = l1_rows.sum() / max(1, x2d.shape[0])  # the sparse rows' share
    else:
        out, up_val = sparse_ffn(x2d, packed, wu, wd_rows, bu, bd, **rows, reuse_tickets=keep), None
    return reference.ForwardResult(out, packed, up_val, None, l1)


def backward(dout2d, x2d, wg, wu, wd, bg, bu, bd, packed: TwellPacked, up_val, l1_scale, *, layer: Optional[int] = None):
    """Gradients of ``loss + l1_scale · L1``, on the path the forward took (``layer``: the
    forward's, when known; a layer compiled for CUDA graphs caches nothing per weight)."""
    key = packed.count.data_ptr()
    if _DENSE_FORWARDS.get(key, False) or x2d.dtype == torch.float64:
        # The popped activations go straight in: no reference here outlives their last use there.
        return _dense_backward(dout2d, x2d, wg, wu, wd, bg, bu, bd, l1_scale,
                               _take_saved(key, dense=True))
    from twell_compile.kernels.sparse_ffn_bwd import DENSE_WGRAD_GEMM_ROWS, sparse_ffn_backward

    keep = layer not in _CUDA_GRAPH_LAYERS
    # the forward's under capture; else once here (cached unless the layer is compiled for CUDA graphs)
    _, backward_bound, wd_rows = _take_saved(key, dense=False) or _WeightPrep.get(wg, wu, wd, bg, bu, bd, keep=keep)
    dense_rows, listed = _backward_guard_rows(dout2d, backward_bound, packed, keep=keep)
    # The dense rows' weight gradients as GEMMs (an fp32 [planes, H, D] buffer) when the layer's
    # last measured call had enough of them; the same result either way.
    policy = None if layer is None else _policy(layer, x2d.device, create=False)
    gemm = policy is not None and policy.expects_dense_rows(x2d.shape[0], DENSE_WGRAD_GEMM_ROWS)
    args = (dout2d, x2d, wg, wu, wd_rows, bg, bu, bd, packed, up_val, dense_rows, l1_scale)
    grads = sparse_ffn_backward(*args, dense_wgrad_gemm=gemm, row_list=listed, reuse_tickets=keep)
    signature = ("backward", *_signature(x2d, wg, wu, bg, bu, bd, True))
    if not _capturing() and signature not in _WARM:
        _tune_other_wgrad(args, gemm, listed, keep)
        _WARM.add(signature)
    return grads


def _tune_other_wgrad(args: tuple, gemm: bool, listed, keep: bool) -> None:
    """Run the problem's first sparse backward once more with the other weight-gradient variant
    (with or without the dense rows' GEMM buffer), result discarded, so that both are compiled and
    tuned at the start. Each variant tunes on its first call: on the H200 at the 2B shape 4.5 and
    6.4 s, which otherwise fell in the middle of training, on the step where a layer first had
    ``DENSE_WGRAD_GEMM_ROWS`` dense rows (session 17). Out of memory here only leaves it for later."""
    from twell_compile.kernels.sparse_ffn_bwd import sparse_ffn_backward

    try:
        sparse_ffn_backward(*args, dense_wgrad_gemm=not gemm, row_list=listed, reuse_tickets=keep)
    except torch.cuda.OutOfMemoryError:
        pass


def _dense_backward(dout, x, wg, wu, wd, bg, bu, bd, l1_scale, saved=None) -> reference.Grads:
    """Dense autograd's formulas in the input dtype, on the forward's ``saved = (act, up, h)``,
    or on them recomputed from ``x`` when the forward kept none.

    The element-wise steps (L1 term, ReLU's ``threshold_backward``: ``0 where act <= 0``, NaN
    passes, and the products) run as one pass, ``dense_act.dense_activation_backward``, bitwise
    eager's result; the L1 scale is cast to the input dtype first, as autograd's scalar gradient
    is. Each ``[M, H]`` tensor is dropped as soon as it is used for the last time (autograd frees
    saved tensors node by node), and ``dh`` becomes ``d_up`` in place, so the peak stays near
    dense autograd's.
    """
    from twell_compile.kernels.dense_act import dense_activation_backward

    gated = wg is not None
    if saved is not None:
        act, up, h = saved
        saved = None  # the caller passes the registry's only reference
    else:
        up = F.linear(x, wu, bu)
        act = torch.relu(F.linear(x, wg, bg) if gated else up)
        h = act * up if gated else act
    coef = (l1_scale / max(1, x.shape[0])).to(x.dtype)
    dh = dout @ wd
    dwd = dout.T @ h
    # dh += sign(h)·coef, then d_gate and d_up (into dh's storage), in one pass
    d_gate, d_up = dense_activation_backward(dh, h, act, coef, up if gated else None)
    del h, up, act, dh
    dx = torch.addmm(d_gate @ wg, d_up, wu) if gated else d_up @ wu
    return reference.Grads(
        dx=dx,
        dwg=d_gate.T @ x if gated else None,
        dwu=d_up.T @ x,
        dwd=dwd,
        dbg=d_gate.sum(0) if (gated and bg is not None) else None,
        dbu=d_up.sum(0) if bu is not None else None,
        dbd=dout.sum(0) if bd is not None else None,
    )


# ---------------------------------------------------------------------------------------------
# The finiteness guard (kernels/reference.py, "Exactness guard"), in one pass over the rows
# ---------------------------------------------------------------------------------------------


class _WeightPrep:
    """The per-weight work, cached while the weights are unchanged: the guard's bounds for
    ``sparse_ffn(guard_bound=...)`` and ``dense_rows.flag_rows`` and ``Wdᵀ`` rows for the sparse kernels (which read columns of Wd as
    rows), made by one launch (``weights.weight_prep``).

    Made again after every change of a weight (each optimizer step bumps its in-place version
    counter), on every call under CUDA-graph capture (replays then see the weights of their own
    step), for inference-mode tensors (no version counter), where nothing can notice a change,
    and with ``keep=False`` (layers compiled for CUDA graphs, whose warm-up runs in the graphs'
    memory pool, where a kept tensor is an error). One entry per down weight, as its ``Wdᵀ`` copy
    is as large as the weight: keyed by the tensor itself and the state (``_state_key``) of all
    six tensors, and freed with the weight.
    """

    _cache: "dict[int, tuple]" = {}

    @classmethod
    def get(cls, wg, wu, wd, bg, bu, bd, *, keep: bool = True):
        """``(forward bound, backward bound, wd_rows)`` (``weights.weight_prep``)."""
        from twell_compile.kernels.weights import weight_prep

        tensors = (wg, wu, wd, bg, bu, bd)
        states = tuple(None if t is None else _state_key(t) for t in tensors)
        cachable = keep and not _capturing() and all(t is None or k is not None for t, k in zip(tensors, states))
        key = id(wd)
        if cachable:
            hit = cls._cache.get(key)
            if hit is not None and hit[0]() is wd and hit[1] == states:
                return hit[2]
        prep = weight_prep(wg, wu, wd, bg, bu, bd, reuse_tickets=keep, down_rows=True)
        if cachable:
            cls._cache[key] = (weakref.ref(wd, lambda _, k=key: cls._cache.pop(k, None)), states, prep)
        return prep


def _backward_guard_rows(dout, backward_bound, packed: TwellPacked, *, keep: bool = True):
    """``(bool [M], RowList)``: backward dense rows and their list, in one kernel: rows with an
    overflowed tile (which include the rows the forward's guard sent dense, marked in the counts by
    ``sparse_ffn``'s guard, and every row of a dense forward), and rows of ``dout`` that are non-finite
    or, gated, whose ``dh = dout·Wd`` may overflow (``backward_bound``: ``_WeightPrep``'s)."""
    from twell_compile.kernels.dense_rows import flag_rows

    return flag_rows(dout, backward_bound, count=packed.count, slots=DEFAULT_LAYOUT.slots, flag_overflow=True,
                     with_list=True, reuse_tickets=keep)
