"""What the backend did (``report()``) and what the rewritten layers do at run time (``stats()``)."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Optional

from .lowering import telemetry


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
_next_layer = 0


def new_layer_id() -> int:
    global _next_layer
    with _lock:
        _next_layer += 1
        return _next_layer - 1


def record(rewritten: list[Rewritten], skipped: list[Skipped]) -> None:
    with _lock:
        _current.rewritten.extend(rewritten)
        _current.skipped.extend(skipped)
        _current.graphs += 1


def report() -> Report:
    """What the backend did since the last ``reset()`` (a copy)."""
    with _lock:
        return Report(list(_current.rewritten), list(_current.skipped), _current.graphs)


def reset() -> None:
    """Forget the report, the layers' run-time counters and any ``set_l1_coeff`` value that
    layers rewritten from now on would start from (live layers keep their current value)."""
    from .l1 import clear_l1_override

    with _lock:
        _current.rewritten.clear()
        _current.skipped.clear()
        _current.graphs = 0
    telemetry.reset()
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

    def __str__(self) -> str:
        if not self.layers:
            return "twell: no rewritten layer has run yet"
        rows = [[str(s.layer), s.where, str(s.calls), str(s.tokens), f"{s.l0:.1f}", "-" if s.l1 is None else f"{s.l1:.4g}", str(s.dense_rows), s.path] for s in self.layers]
        return _table(["layer", "where", "calls", "tokens", "L0 (active/token)", "L1", "dense rows", "path"], rows)

    __repr__ = __str__


def stats() -> Stats:
    """Per-layer telemetry from the last call of each rewritten layer (synchronises the device)."""
    where = {r.layer: r.where for r in report().rewritten}
    where.update(_patched_where)
    out = []
    for layer, v in telemetry.snapshot().items():
        tokens = int(v["tokens"])
        l1 = v["l1"]
        dense_rows = int(v["dense_rows"])
        out.append(
            LayerStats(
                layer=layer,
                where=where.get(layer, "?"),
                calls=int(v["calls"]),
                tokens=tokens,
                l0=v["active"] / max(1, tokens),
                l1=None if l1 != l1 else l1,
                dense_rows=dense_rows,
                path="sparse" if v["sparse"] and dense_rows < tokens else "dense",
            )
        )
    return Stats(out)


_patched_where: dict[int, str] = {}


def name_patched_layer(layer: int, where: str) -> None:
    """Let ``stats()`` name layers rewritten by ``patch()`` (they are not in the compile report)."""
    _patched_where[layer] = where


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])
