"""The CUDA ops' per-layer choice between the sparse and the dense path.

Each layer picks its path from its **previous** call's counters, copied to pinned host memory
asynchronously and read only once the copy's event has completed (``event.query()``), so the hot
path never synchronises the host. A layer starts dense (early in training a ReLU FFN is ~50%
dense) and turns sparse once its measured density drops below ``SPARSE_MAX_DENSITY`` (per mode)
on calls of at least ``SPARSE_MIN_TOKENS`` tokens, while few of its rows are computed densely
(``SPARSE_MAX_DENSE_ROWS``). Both paths compute the same function for every input
(docs/architecture.md, 'Exactness contract'): the choice costs or saves time, never correctness.

Under CUDA-graph capture the path chosen at capture is the one recorded and replayed (host-side
decisions cannot run inside a graph replay): sparse from ``SPARSE_MIN_TOKENS_CAPTURED`` tokens
(below ``SPARSE_FULL_TOKENS_CAPTURED`` tokens only at a density under
``SPARSE_MAX_DENSITY_FEW_TOKENS``) when the layer's density was known before the capture and its
problem's kernels were tuned outside it (``WARM``). ``force_path`` overrides the choice for
benchmarks and tests.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from . import cuda_graphs, telemetry

# Below these fractions of active gate units the sparse path is taken: at or below the crossover
# of forced sparse against dense eager with skewed neurons, the heavy rows of real models in mind.
# H200, bf16, D=2048, H=5632, M=16384: inference 1.04x / 1.05x (uniform / skewed neurons) at 1.1%
# against 1.03-1.04x for the dense path; a training step 1.22x / 1.21x at 1%, against 1.13x.
SPARSE_MAX_DENSITY = {"inference": 0.0105, "training": 0.0105}
# Below this many tokens per call the sparse path is bound by its host time (op dispatch, Triton
# launches, guard and telemetry ops: ~1.0 ms a call on the H200's host), which dense cuBLAS at
# D=2048, H=5632 undercuts below ~9.4k tokens (M=4096: sparse 1.40 ms, dense 0.44 ms).
SPARSE_MIN_TOKENS = 12288
# Inside a CUDA graph there is no host time to pay, so the sparse path beats dense from fewer
# tokens: a capture (or a call replayed from a graph of its own, ``call_replay``)
# records it from SPARSE_MIN_TOKENS_CAPTURED tokens, below
# SPARSE_MAX_DENSITY_FEW_TOKENS until SPARSE_FULL_TOKENS_CAPTURED tokens and below
# SPARSE_MAX_DENSITY from there. H200, every provider captured, forced sparse against dense,
# uniform neurons, inference:
SPARSE_MIN_TOKENS_CAPTURED = 3072  # 1.12x at 3072 tokens and 0.5%; 0.98x at 2048 tokens
SPARSE_FULL_TOKENS_CAPTURED = 8192  # at 1.05%: 0.93x at 3072 tokens, 1.02x at 8192
SPARSE_MAX_DENSITY_FEW_TOKENS = 0.007  # at 3072 tokens: 1.04x at 0.8%, 0.93x at 1.05%
# Above these fractions of rows computed densely (overflow, guard) the dense path is faster. H200,
# M=16384, 0.5% density: each such row adds ~0.7 us to an inference call (1.29 -> 1.47 ms with 256
# rows; dense 1.70) and ~2.7 us to a training step (3.96 -> 4.66 ms; the dense path 5.0). Neither
# may exceed the kernels' DENSE_ROW_FRACTION_MAX, the rows their scratch holds.
SPARSE_MAX_DENSE_ROWS = {"inference": 0.02, "training": 0.015}
# The same for a layer recorded in a CUDA graph, which replays its path for good. H200, the 2B
# Llama under mode="reduce-overhead" with 0.57% dense rows: every layer sparse ran 0.99x of
# Inductor's graphs, 1.01x with this limit (which kept 36 of 38 layers dense).
SPARSE_MAX_DENSE_ROWS_CAPTURED = 0.001


def density_limit(training: bool, tokens: Optional[int] = None) -> float:
    """The density under which the sparse path is taken: ``SPARSE_MAX_DENSITY``, lowered to
    ``SPARSE_MAX_DENSITY_FEW_TOKENS`` for calls of fewer than ``SPARSE_FULL_TOKENS_CAPTURED``
    tokens (only calls without host time to pay, captured or replayed, are that small)."""
    limit = SPARSE_MAX_DENSITY["training" if training else "inference"]
    if tokens is not None and tokens < SPARSE_FULL_TOKENS_CAPTURED:
        limit = min(limit, SPARSE_MAX_DENSITY_FEW_TOKENS)
    return limit


class LayerPolicy:
    """Per (layer, device): the path to take, from the last completed counters copy."""

    hidden = 1  # the layer's H, set by each call (``after``)

    def __init__(self) -> None:
        self.host = torch.zeros(len(telemetry.FIELDS), dtype=torch.float64, pin_memory=True)
        self.event: Optional[torch.cuda.Event] = None
        self.density = 1.0  # unknown until the first call's counters arrive: start dense
        self.dense_row_fraction = 1.0
        self.measured = False  # whether counters have arrived yet
        self.calls = 0
        self.tokens = 0  # of the last measured call

    def refresh(self) -> None:
        """Take the last counters copy in, if it has completed (no sync)."""
        if self.event is not None and not cuda_graphs.capturing() and self.event.query():
            v = dict(zip(telemetry.FIELDS, self.host.tolist()))  # completed copy: no sync
            tokens = max(1.0, v["tokens"])
            self.density = v["active"] / tokens / max(1.0, self.hidden)
            self.dense_row_fraction = v["dense_rows"] / tokens
            self.tokens = int(tokens)
            self.event = None
            self.measured = True

    def expects_dense_rows(self, tokens: int, rows: int) -> bool:
        """Whether a call of ``tokens`` tokens should expect ``rows`` or more dense rows, from the
        last measured call (False until one is)."""
        self.refresh()
        return self.measured and self.dense_row_fraction * tokens >= rows

    def choose(self, training: bool, tokens: Optional[int] = None) -> bool:
        """Whether the last measured call's density and dense rows favour the sparse path (for a
        call of ``tokens`` under ``SPARSE_FULL_TOKENS_CAPTURED``: a lower density limit)."""
        self.refresh()
        mode = "training" if training else "inference"
        return (self.density < density_limit(training, tokens)
                and self.dense_row_fraction < SPARSE_MAX_DENSE_ROWS[mode])

    def choose_captured(self, training: bool, tokens: int) -> bool:
        """The same for a call of ``tokens`` tokens that a CUDA graph records, which replays its
        path for good: sparse from ``SPARSE_MIN_TOKENS_CAPTURED`` tokens, under a stricter limit
        on the rows computed densely, and a lower density limit below
        ``SPARSE_FULL_TOKENS_CAPTURED`` tokens."""
        self.refresh()
        if tokens < SPARSE_MIN_TOKENS_CAPTURED:
            return False
        return self.density < density_limit(training, tokens) and self.dense_row_fraction < SPARSE_MAX_DENSE_ROWS_CAPTURED

    def settle(self) -> None:
        """Wait for the pending counters copy: a host sync, for CUDA-graph warm-ups only."""
        if self.event is not None:
            self.event.synchronize()

    def after(self, buf: torch.Tensor, hidden: int) -> None:
        """Count a call and start copying its counters ``buf`` to the host (unless a copy is
        pending, or under capture, where a replay would not redo it)."""
        self.calls += 1
        self.hidden = hidden
        if self.event is None and not cuda_graphs.capturing():
            self.host.copy_(buf, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()


# (layer, device index) -> the layer's policy on that device
POLICIES: dict[tuple[int, int], LayerPolicy] = {}
_lock = threading.Lock()


def layer_policy(layer: int, device: torch.device, *, create: bool = True) -> Optional[LayerPolicy]:
    """The layer's policy on ``device``; with ``create=False`` None if it has none yet (a
    backward must not create policy state, which would also need pinned memory)."""
    key = (layer, device.index or 0)
    p = POLICIES.get(key)
    if p is None and create:
        with _lock, torch.inference_mode(False):  # its pinned copy is updated in place on later calls
            p = POLICIES.setdefault(key, LayerPolicy())
    return p


# Problems whose sparse kernels have run outside capture, so are tuned and compiled ("warm"): a
# capture takes the sparse path only for those, since autotuning cannot run inside a capture. Keys:
# ("forward" | "backward", *problem_signature(...)); the kernels' tuning keys never depend on the
# token count. Read as ``dispatch_policy.WARM`` at call time (never bound by name elsewhere), so
# that replacing the set reaches every reader.
WARM: set = set()


def problem_signature(x2d, wg, wu, bg, bu, bd, training: bool) -> tuple:
    """What the kernels' tuning depends on: device, dtype, D, H, gated, the biases' dtypes, mode."""
    return (x2d.device, x2d.dtype, x2d.shape[1], wu.shape[0], wg is not None,
            *(None if b is None else b.dtype for b in (bg, bu, bd)), training)


def is_warm(signature: tuple) -> bool:
    """Whether the problem's forward (and, in training, backward) sparse kernels are tuned."""
    training = signature[-1]
    return ("forward", *signature) in WARM and (not training or ("backward", *signature) in WARM)


def takes_sparse(policy: LayerPolicy, tokens: int, signature: tuple, training: bool, capturing: bool,
                 replayed: bool = False) -> bool:
    """Whether a call of ``tokens`` tokens takes the sparse path. In a capture: as
    ``choose_captured`` says, once the problem is warm. Outside: as ``choose`` says, from
    ``SPARSE_MIN_TOKENS`` tokens, or from ``SPARSE_MIN_TOKENS_CAPTURED`` for a call whose launches
    are ``replayed`` from a CUDA graph (``call_replay``: no host time to pay either, and the path is
    chosen again on every call); and a call that a capture would send sparse goes sparse while its
    problem is cold, once, so that its kernels are tuned before any capture."""
    if capturing:
        return policy.choose_captured(training, tokens) and is_warm(signature)
    if tokens >= SPARSE_MIN_TOKENS:
        return policy.choose(training)
    if replayed and tokens >= SPARSE_MIN_TOKENS_CAPTURED:
        return policy.choose(training, tokens)
    if is_warm(signature):
        # Dense by its token count alone, but the layer's counters are still taken in: a later
        # capture, which cannot read them, must find its density measured.
        policy.refresh()
        return False
    return policy.choose_captured(training, tokens)


def prefers_sparse(layer: int, device: torch.device, training: bool, cuda_graphs: bool) -> bool:
    """Whether the layer's last measured call favours the sparse path (by density and dense rows,
    and in CUDA graphs by its token count, as a capture would decide), with no host sync and no
    side effect on the op's own choices; False before its first counters arrive. The caller
    (twell_compile's graph variants) measures whether the sparse path's host time pays."""
    policy = layer_policy(layer, device, create=False)
    if policy is None:
        return False
    policy.refresh()  # nothing else takes in the counters of a layer that ran no op
    if cuda_graphs:
        return policy.measured and policy.choose_captured(training, policy.tokens)
    return policy.measured and policy.choose(training)


def watch_counters(layer: int, device: torch.device, hidden: int) -> None:
    """Start copying the layer's counters to the host, as an op call does, for a layer whose call
    ran no op (it ran dense code compiled by Inductor, which writes the same counters). CUDA only,
    as the policies are."""
    if device.type == "cuda":
        layer_policy(layer, device).after(telemetry.buffer(layer, device), hidden)


# ---------------------------------------------------------------------------------------------
# Forcing one path
# ---------------------------------------------------------------------------------------------

PATHS = ("sparse", "dense")
# The path ``force_path`` forces, or None: the policy chooses. Set it only through ``force_path``;
# the ops read it once per call, as ``dispatch_policy.FORCED_PATH``.
FORCED_PATH: Optional[str] = None


class force_path:  # noqa: N801 - a context manager, named like torch.no_grad
    """``with force_path("sparse"):`` (or ``"dense"``): every CUDA call of the TwELL ops inside the
    block takes that path, whatever its layer's policy would choose; the previous setting (the
    policy, or an enclosing ``force_path``) is back on exit, also when the block raises.

    For benchmarks timing one path and tests that need one. Process-wide (not per thread), and
    read once per call, when the op runs: a graph captured earlier replays the path it recorded.
    A forced call never prepares a CUDA-graph capture (``capture.prepare_capture``), and float64
    inputs always take the dense path.
    """

    __slots__ = ("path", "_before")

    def __init__(self, path: str) -> None:
        if path not in PATHS:
            raise ValueError(f"twell: force_path takes 'sparse' or 'dense', got {path!r}")
        self.path = path

    def __enter__(self) -> "force_path":
        global FORCED_PATH
        self._before, FORCED_PATH = FORCED_PATH, self.path
        return self

    def __exit__(self, *exc) -> None:
        global FORCED_PATH
        FORCED_PATH = self._before
