"""What the backend did (``report()``) and what the rewritten layers do at run time (``stats()``)."""

from __future__ import annotations

import dataclasses
import enum
import threading
from dataclasses import dataclass, field
from typing import Optional

from .lowering import telemetry
from .options import quiet


class SkipReason(enum.Enum):
    """Why an FFN-like pattern was left alone. The closed set ``report().skipped`` shows."""

    MULTI_USER = "an intermediate value has another user (for example it is logged or used in the loss)"
    NO_DOWN_PROJECTION = "the ReLU output does not feed a linear down projection"
    NOT_AN_UP_PROJECTION = "the gate multiplies a value that is not a linear projection of the same input"
    NOT_A_WEIGHT = "a projection's weight is not a 2-D tensor in nn.Linear layout"
    SHAPE_MISMATCH = "the weight and bias shapes do not form one FFN"
    UNSUPPORTED_DTYPE = "the dtype is not float16, bfloat16 or float32"
    MIXED_DTYPES = "the inputs and weights have different dtypes outside autocast"
    MIXED_DEVICES = "the inputs and weights are on different devices"
    NOT_WHOLE_MODULE = "the module's forward does more than the FFN, so patch() cannot replace it (torch.compile can)"
    EXTRA_INPUTS = "the module's forward takes more than one input, so patch() cannot replace it (torch.compile can)"
    GRAPH_SPLIT = ("the FFN is cut by a graph boundary (a DDP bucket split or a graph break), so no graph holds all of it: "
                   "patch the model before wrapping it (twell_compile.patch, or TWELL=1), or set "
                   "torch._dynamo.config.optimize_ddp = False")
    EXTRA_TERM = ("a projection is x·Wᵀ + b plus another term (a LoRA adapter?): merge the adapters before compiling "
                  "(merge_and_unload()), or use twell_compile.patch / TWELL=1, which merge them at call time")
    NOT_RELU = "the gate activation is not ReLU: relu_gate=True (TWELL_RELU_GATE=1) trains it as a ReLU FFN"
    TRACE_FAILED = "torch.fx could not trace the module, so patch() cannot tell whether it is an FFN"
    PATCH_FALLBACK = "a patched module runs its own forward, without the TwELL op or its L1 term"
    TENSOR_PARALLEL = ("the projections' weights are sharded DTensors (tensor parallelism), which the TwELL ops do not "
                       "take (docs/distributed.md)")
    INTERNAL_ERROR = "the matcher failed unexpectedly; the graph was left unchanged"

    @property
    def text(self) -> str:
        return self.value


@dataclass(frozen=True)
class Rewritten:
    """One FFN replaced by a TwELL op."""

    layer: int  # telemetry id, the key of stats()
    where: str  # module path or source line of the down projection
    kind: str  # "gated" or "plain"
    biases: str  # which projections have a bias, e.g. "gate,up,down" or "none"
    dtype: str  # dtype the op runs in (the autocast dtype under autocast)
    op: str  # "twell::ffn" (inference) or "twell::ffn_train"
    graph: str = ""


@dataclass(frozen=True)
class Skipped:
    """An FFN-like pattern left unchanged, and why."""

    where: str
    reason: SkipReason
    detail: str = ""
    graph: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.reason.text}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class Report:
    """Rewrites and skips since the last ``twell_compile.reset()``; prints as a table."""

    rewritten: list[Rewritten] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    graphs: int = 0  # graphs the backend (or the pre-grad pass) processed

    def __str__(self) -> str:
        lines = [f"twell: rewrote {len(self.rewritten)} FFN(s), skipped {len(self.skipped)}, in {self.graphs} graph(s)"]
        if self.rewritten:
            lines.append(_table(["layer", "where", "kind", "biases", "dtype", "op"], [[str(r.layer), r.where, r.kind, r.biases, r.dtype, r.op] for r in self.rewritten]))
        if self.skipped:
            lines.append("skipped:")
            lines.append(_table(["where", "reason"], [[s.where, s.reason.text + (f" ({s.detail})" if s.detail else "")] for s in self.skipped]))
        return "\n".join(lines)

    __repr__ = __str__


_lock = threading.Lock()
_current = Report()


def record(rewritten: list[Rewritten], skipped: list[Skipped], *, graphs: int = 1) -> None:
    with _lock:
        _current.rewritten.extend(rewritten)
        _current.skipped.extend(skipped)
        _current.graphs += graphs


def report() -> Report:
    """What the backend did since the last ``reset()`` (a copy)."""
    with _lock:
        return Report(list(_current.rewritten), list(_current.skipped), _current.graphs)


def reset() -> None:
    """Forget the report, the layers' run-time counters and any ``set_l1_coeff`` value that
    layers rewritten from now on would start from (live layers keep their current value)."""
    from . import layers, variants
    from .l1 import clear_l1_override

    with _lock:
        _current.rewritten.clear()
        _current.skipped.clear()
        _current.graphs = 0
    telemetry.reset()
    layers.reset()
    variants.reset()
    clear_l1_override()


@dataclass(frozen=True)
class LayerStats:
    """The last call's counters of one rewritten layer."""

    layer: int
    where: str
    calls: int
    tokens: int
    l0: float  # active neurons per token
    l1: Optional[float]  # (1/T) Σ|h| of the last training call; None for inference calls
    dense_rows: int  # rows computed densely (overflowed tiles or the finiteness guard)
    path: str  # "sparse" or "dense"
    model: str = ""  # the model the layer belongs to (its class name, numbered when several)
    hidden: int = 0  # H, so l0 / hidden is the density
    l1_coeff: Optional[float] = None  # the layer's current L1 coefficient (None before a training call)
    target_density: Optional[float] = None  # the density the coefficient is steered to, if any
    dead_neurons: Optional[float] = None  # share of neurons with no activation within the window

    @property
    def density(self) -> Optional[float]:
        return self.l0 / self.hidden if self.hidden else None


@dataclass
class Stats:
    layers: list[LayerStats]

    @property
    def l1(self) -> Optional[float]:
        """Mean over layers of the last L1 values: the quantity ``l1_coeff`` multiplies."""
        values = [s.l1 for s in self.layers if s.l1 is not None]
        return sum(values) / len(values) if values else None

    @property
    def l0(self) -> Optional[float]:
        return sum(s.l0 for s in self.layers) / len(self.layers) if self.layers else None

    @property
    def density(self) -> Optional[float]:
        """Mean over layers of the active share of the hidden units."""
        values = [s.density for s in self.layers if s.density is not None]
        return sum(values) / len(values) if values else None

    def __str__(self) -> str:
        if not self.layers:
            return "twell: no rewritten layer has run yet"
        models = len({s.model for s in self.layers}) > 1
        header = (["model"] if models else []) + ["layer", "where", "calls", "tokens", "L0 (active/token)", "density", "L1",
                                                  "l1_coeff", "dead", "dense rows", "path"]
        rows = []
        for s in self.layers:
            density = "-" if s.density is None else f"{s.density:.3%}"
            target = "" if s.target_density is None else f" (target {s.target_density:.2%})"
            rows.append(([s.model] if models else []) + [
                str(s.layer), s.where, str(s.calls), str(s.tokens), f"{s.l0:.1f}", density + target,
                "-" if s.l1 is None else f"{s.l1:.4g}", "-" if s.l1_coeff is None else f"{s.l1_coeff:.3g}",
                "-" if s.dead_neurons is None else f"{s.dead_neurons:.1%}", str(s.dense_rows), s.path])
        return _table(header, rows)

    __repr__ = __str__


def stats(model=None, *, reduce: bool = False) -> Stats:
    """Per-layer telemetry from the last call of each rewritten layer (synchronises the device).

    Args:
        model: only this model's layers (a module, or its ``torch.compile``/DDP wrapper).
        reduce: under ``torch.distributed``, sum the counters over the ranks (every rank must
            call it, as for any collective): tokens, active entries and dense rows are summed,
            L0 and L1 become means over all ranks' tokens, a layer's path is "sparse" only if
            it was on every rank. The hot path is untouched; the collective runs here.
    """
    rows = _local_stats(model)
    return Stats(_all_reduced(rows) if reduce else rows)


def _all_reduced(rows: list[LayerStats]) -> list[LayerStats]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return rows
    keys = [(r.model, r.where) for r in rows]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, keys)
    common = set(keys).intersection(*map(set, everyone))
    rows = sorted((r for r in rows if (r.model, r.where) in common), key=lambda r: (r.model, r.where))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    values = torch.tensor([[r.calls, r.tokens, r.l0 * r.tokens, r.dense_rows, (r.l1 or 0.0) * r.tokens,
                            float(r.l1 is not None) * r.tokens, float(r.path == "sparse")] for r in rows],
                          dtype=torch.float64, device=device).reshape(len(rows), 7)
    dist.all_reduce(values)
    world = dist.get_world_size()
    out = []
    for r, (calls, tokens, active, dense, l1_sum, l1_tokens, sparse) in zip(rows, values.tolist()):
        out.append(dataclasses.replace(
            r, calls=int(calls), tokens=int(tokens), l0=active / max(1.0, tokens), dense_rows=int(dense),
            l1=l1_sum / l1_tokens if l1_tokens else None, path="sparse" if sparse == world else "dense"))
    return out


def _local_stats(model=None) -> list[LayerStats]:
    from . import layers
    from .module_paths import unwrap

    wanted = layers.model_of(unwrap(model)) if model is not None else None
    entries = {}
    for layer_id, v in telemetry.snapshot().items():
        entry = layers.layer(layer_id)
        if wanted is not None and (entry is None or entry.model is not wanted):
            continue
        entries[layer_id] = (entry, v)
    labels = _model_labels([e.model for e, _ in entries.values() if e is not None])
    out = []
    for layer_id, (entry, v) in entries.items():
        tokens = int(v["tokens"])
        l1 = v["l1"]
        dense_rows = int(v["dense_rows"])
        coefficients = list(entry.coefficients.values()) if entry is not None else []
        controller = getattr(entry.model, "controller", None) if entry is not None else None
        out.append(
            LayerStats(
                layer=layer_id,
                where=layers.name_of(layer_id),
                calls=int(v["calls"]),
                tokens=tokens,
                l0=v["active"] / max(1, tokens),
                l1=None if l1 != l1 else l1,
                dense_rows=dense_rows,
                path="sparse" if v["sparse"] and dense_rows < tokens else "dense",
                model=labels.get(id(entry.model), "") if entry is not None else "",
                hidden=entry.hidden if entry is not None else 0,
                l1_coeff=float(coefficients[0]) if coefficients else None,
                target_density=None if controller is None else controller.target,
                dead_neurons=telemetry.dead_share(layer_id),
            )
        )
    return out


def _model_labels(models) -> dict[int, str]:
    """Class names, numbered where two models share one (``LlamaForCausalLM#2``)."""
    labels, seen = {}, {}
    for m in models:
        if id(m) in labels:
            continue
        seen[m.label] = seen.get(m.label, 0) + 1
        labels[id(m)] = m.label if seen[m.label] == 1 else f"{m.label}#{seen[m.label]}"
    return labels


_warned: set = set()


def warn_unrewritten(label: str, key, skipped: list[Skipped], context: str, stacklevel: int = 3) -> None:
    """Once per ``key`` (a model and its reasons): twell was asked for, FFN-like patterns were found
    and none was rewritten, so the L1 term is silently missing unless someone says so."""
    import warnings

    if quiet():
        return
    reasons = sorted({s.reason for s in skipped}, key=lambda r: r.name)
    key = (key, tuple(reasons))
    if key in _warned:
        return
    _warned.add(key)
    why = "; ".join(f"{r.text} ({sum(s.reason is r for s in skipped)} pattern(s))" for r in reasons)
    warnings.warn(f"twell: no FFN of {label} has been rewritten ({context}): {why}. Its L1 term is not injected; "
                  "twell_compile.report() lists the patterns.", RuntimeWarning, stacklevel=stacklevel)


def name_pattern(names: list[str], limit: int = 3) -> str:
    """Layer names with their numbered parts folded: ``model.layers.*.mlp``."""
    patterns: list[str] = []
    for name in names:
        folded = ".".join("*" if part.isdigit() else part for part in name.split("."))
        if folded not in patterns:
            patterns.append(folded)
    shown = ", ".join(patterns[:limit])
    return shown + (f", and {len(patterns) - limit} more" if len(patterns) > limit else "")


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])
