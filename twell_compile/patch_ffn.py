"""Eager rewrite of FFN modules, for scripts that never compile and for DDP.

``patch(model)`` traces each small module that could be an FFN (two or three ``nn.Linear``
children) with ``torch.fx.symbolic_trace``, linears and ReLUs inlined, so the graph has the same
``F.linear`` / ``F.relu`` nodes Dynamo produces and the same matcher (``match_ffn``) decides. A
module whose whole forward is one FFN gets a new ``forward`` that calls the TwELL op. The weights
are looked up on the module at call time (FSDP swaps the Parameter objects), and autocast and
grad mode are read at call time too.

Under DDP with ``torch.compile``, DDPOptimizer splits Dynamo graphs at bucket boundaries, usually
inside an FFN; a patched FFN is a single op, so it stays whole (DESIGN.md section 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx, nn

from . import lowering  # noqa: F401  (registers torch.ops.twell.*)
from . import reporting
from .l1 import coefficient_tensor
from .match_ffn import FfnMatch, find_ffns
from .options import TwellOptions
from .reporting import Rewritten, SkipReason, Skipped

_PATCHED_ATTR = "_twell_patched_layer"


@dataclass
class PatchResult:
    """What ``patch`` did; prints like the compile report."""

    rewritten: list[Rewritten] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def __str__(self) -> str:
        return str(reporting.Report(self.rewritten, self.skipped, graphs=0)).replace(" in 0 graph(s)", " (eager patch)")


def patch(model: nn.Module, **options) -> PatchResult:
    """Rewrite every FFN module of ``model`` in place to call the TwELL ops.

    Args:
        model: any module; FFN submodules are found by tracing, not by class name.
        **options: ``l1_coeff`` and ``strict``, as for the backend (``inner`` is ignored).

    Returns:
        A ``PatchResult`` with the rewritten modules and the FFN-like ones left alone.

    Example::

        >>> result = twell_compile.patch(model, l1_coeff=2e-5)
        >>> print(result)
    """
    opts = TwellOptions.from_dict(options)
    candidates = [(name, mod) for name, mod in model.named_modules() if _is_candidate(mod)]
    found: list[tuple[str, nn.Module, fx.GraphModule, FfnMatch]] = []
    result = PatchResult()
    for name, mod in candidates:
        traced = _trace(mod)
        if traced is None:
            continue
        matches, skipped = find_ffns(traced)
        where = name or type(model).__name__
        result.skipped.extend(Skipped(f"{where}.{s.where}", s.reason, s.detail, "patch") for s in skipped)
        if len(matches) == 1 and _is_whole_forward(traced, matches[0]):
            found.append((where, mod, traced, matches[0]))
        elif matches:
            result.skipped.append(Skipped(where, SkipReason.NOT_WHOLE_MODULE, f"{len(matches)} FFN(s) inside a larger forward", "patch"))
    if opts.strict and result.skipped:
        from .rewrite_ffn import TwellRewriteError

        details = "\n".join(f"  - {s}" for s in result.skipped)
        raise TwellRewriteError(f"twell (strict=True): {len(result.skipped)} FFN-like pattern(s) cannot be patched:\n{details}")
    coefficients: dict[str, torch.Tensor] = {}
    for where, mod, traced, m in found:
        layer = reporting.new_layer_id()
        lowering.telemetry.ensure(layer, next(mod.parameters()).device)
        mod.forward = _patched_forward(mod, _attribute_paths(m), len(found), layer, opts.l1_coeff, coefficients)
        setattr(mod, _PATCHED_ATTR, layer)
        reporting.name_patched_layer(layer, where)
        dtype = next(mod.parameters()).dtype
        biases = ",".join(n for n, b in (("gate", m.gate.bias if m.gate else None), ("up", m.up.bias), ("down", m.down.bias)) if b is not None)
        result.rewritten.append(Rewritten(layer, where, m.kind, biases or "none", str(dtype).replace("torch.", ""), "twell::ffn / ffn_train (patched)", "patch"))
    reporting.record(result.rewritten, result.skipped)
    return result


def _is_candidate(mod: nn.Module) -> bool:
    if hasattr(mod, _PATCHED_ATTR):
        return False
    children = list(mod.children())
    linears = [c for c in children if isinstance(c, nn.Linear)]
    others = [c for c in children if not isinstance(c, nn.Linear)]
    # Anything besides linears must be parameter-free (an activation module, dropout, ...).
    return 2 <= len(linears) <= 3 and all(not any(True for _ in c.parameters()) for c in others)


class _InlineTracer(fx.Tracer):
    """Inline nn.Linear and nn.ReLU so they appear as F.linear / F.relu, as Dynamo shows them."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (nn.Linear, nn.ReLU)):
            return False
        return super().is_leaf_module(m, qualname)


def _trace(mod: nn.Module) -> Optional[fx.GraphModule]:
    """Trace ``mod`` and fill example values by running it on one token; None if untraceable."""
    try:
        graph = _InlineTracer().trace(mod)
        gm = fx.GraphModule(mod, graph)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            return None
        first = next(c for c in mod.children() if isinstance(c, nn.Linear))
        x = torch.zeros(1, first.in_features, dtype=first.weight.dtype, device=first.weight.device)
        _ExampleValues(gm).run(x)
        return gm
    except Exception:  # noqa: BLE001 - a module we cannot trace is simply not an FFN candidate
        return None


class _ExampleValues(fx.Interpreter):
    def run_node(self, n: fx.Node):
        with torch.no_grad():
            value = super().run_node(n)
        n.meta["example_value"] = value
        return value


def _is_whole_forward(gm: fx.GraphModule, m: FfnMatch) -> bool:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return output.args[0] is m.down.out and m.x.op == "placeholder"


def _attribute_paths(m: FfnMatch) -> dict[str, Optional[str]]:
    """Attribute paths (``"gate_proj.weight"``) of the FFN's tensors on the module."""

    def path(node) -> Optional[str]:
        if node is None:
            return None
        if node.op != "get_attr":
            raise ValueError(f"twell: {node.name} is not a module attribute")
        return node.target

    return {
        "wg": path(m.gate.weight) if m.gate else None,
        "wu": path(m.up.weight),
        "wd": path(m.down.weight),
        "bg": path(m.gate.bias) if m.gate else None,
        "bu": path(m.up.bias),
        "bd": path(m.down.bias),
    }


def _patched_forward(mod: nn.Module, paths: dict[str, Optional[str]], n_layers: int, layer: int, l1_coeff: float, coefficients: dict):
    def fetch(path: Optional[str]):
        if path is None:
            return None
        obj = mod
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def forward(x: torch.Tensor) -> torch.Tensor:
        tensors = [fetch(paths[k]) for k in ("wg", "wu", "wd", "bg", "bu", "bd")]
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):  # F.linear would run in the autocast dtype
            dtype = torch.get_autocast_dtype(device_type)
            x = x.to(dtype)
            tensors = [None if t is None else t.to(dtype) for t in tensors]
        wg, wu, wd, bg, bu, bd = tensors
        if torch.is_grad_enabled() and (x.requires_grad or any(t is not None and t.requires_grad for t in tensors)):
            key = str(x.device)
            if key not in coefficients:
                coefficients[key] = coefficient_tensor(l1_coeff, x.device)
            return torch.ops.twell.ffn_train(x, wg, wu, wd, bg, bu, bd, coefficients[key], n_layers, layer)[0]
        return torch.ops.twell.ffn(x, wg, wu, wd, bg, bu, bd, layer)

    return forward
