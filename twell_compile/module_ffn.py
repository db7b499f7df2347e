"""Which modules are one FFN: a module traced with ``torch.fx`` and matched like a compiled graph.

``patch()`` (``patch_ffn.py``) replaces a module's forward only where its whole forward is one FFN
whose projections are its own children (``nn.Linear``, or PEFT LoRA layers around one). Each
candidate (two or three linear children, nothing else with parameters) is traced with linears and
ReLUs inlined, so the graph has the ``F.linear`` / ``F.relu`` nodes Dynamo produces and the same
matcher (``match_ffn``) decides. Example values come from meta tensors of the parameters' shapes
and dtypes, so a module whose parameters are sharded DTensors (FSDP2) traces too. Every FFN-like
module that cannot be replaced is returned as a skip with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from .match_ffn import FfnMatch, find_ffns
from .reporting import SkipReason, Skipped

ROLES = ("gate", "up", "down")


@dataclass(frozen=True)
class Roles:
    """Which child module is each projection of a matched FFN."""

    children: tuple  # (gate child name or None, up child name, down child name)
    kind: str
    biases: str
    gate_activation: str = "ReLU"  # what the module computes; the op computes ReLU


def _linear_like(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or lora_base(m) is not None


def lora_base(m: nn.Module) -> Optional[nn.Linear]:
    """A PEFT LoRA layer's wrapped ``nn.Linear`` (duck-typed: peft need not be installed)."""
    base = getattr(m, "base_layer", None)
    return base if isinstance(base, nn.Linear) and hasattr(m, "lora_A") and hasattr(m, "lora_B") else None


def is_candidate(mod: nn.Module) -> bool:
    children = list(mod.children())
    linears = [c for c in children if _linear_like(c)]
    others = [c for c in children if not _linear_like(c)]
    # Anything besides linears must be parameter-free (an activation module, dropout, ...).
    return 2 <= len(linears) <= 3 and all(not any(True for _ in c.parameters()) for c in others)


class _InlineTracer(fx.Tracer):
    """Inline nn.Linear and nn.ReLU so they appear as F.linear / F.relu, as Dynamo shows them; a
    LoRA layer stays a leaf, which ``_lora_as_linear`` turns into its base layer's ``F.linear``."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if lora_base(m) is not None:
            return True
        if isinstance(m, (nn.Linear, nn.ReLU)):
            return False
        return super().is_leaf_module(m, qualname)


def examine(mod: nn.Module, where: str, training: bool, relu_gate: bool) -> tuple[Optional[Roles], list[Skipped]]:
    """Trace ``mod`` in ``training`` mode and match it: its roles if its whole forward is one FFN
    (a SiLU/GELU-gated one only with ``relu_gate``). An FFN-like module left alone is in the skips."""
    was_training = mod.training
    try:
        mod.train(training)
        gm = _trace(mod)
    except Exception as exc:  # noqa: BLE001 - a module we cannot trace is recorded, never fatal
        return None, [Skipped(where, SkipReason.TRACE_FAILED, f"{type(exc).__name__}: {exc}"[:300], "patch")]
    finally:
        mod.train(was_training)
    matches, skipped = find_ffns(gm)
    skipped = [Skipped(f"{where}.{s.where}", s.reason, s.detail, "patch") for s in skipped]
    inputs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        # The patched forward takes one tensor; what the patterns need from the others is unknown.
        if matches or skipped:
            return None, [Skipped(where, SkipReason.EXTRA_INPUTS, f"forward({', '.join(inputs)})", "patch")]
        return None, []
    if len(matches) == 1 and _is_whole_forward(gm, matches[0]):
        m = matches[0]
        if m.gate_activation != "ReLU" and not relu_gate:
            return None, skipped + [Skipped(where, SkipReason.NOT_RELU, m.gate_activation, "patch")]
        roles = _roles(m)
        if roles is None:  # the patched forward reads the projections from the module's children
            skipped.append(Skipped(where, SkipReason.NOT_WHOLE_MODULE, "a projection's weight is not an nn.Linear child's",
                                   "patch"))
        return roles, skipped
    if matches:
        detail = f"{len(matches)} FFN(s) inside a larger forward"
        if len(matches) == 1 and matches[0].x.op != "placeholder":
            detail = "its input goes through other operations before the FFN"
        skipped.append(Skipped(where, SkipReason.NOT_WHOLE_MODULE, detail, "patch"))
    return None, skipped


def _trace(mod: nn.Module) -> fx.GraphModule:
    """The module's graph, its nodes carrying example values from meta tensors where they depend
    only on the first input (a 2-D ``[1, D]`` tensor, D read from a projection)."""
    graph = _InlineTracer().trace(mod)
    gm = fx.GraphModule(mod, graph)
    _lora_as_linear(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return gm
    dtype = next(mod.parameters()).dtype
    errors = []
    for d_model in _input_features(gm, placeholders[0]):
        try:
            _meta_values(gm, torch.empty(1, d_model, dtype=dtype, device="meta"))
            return gm
        except Exception as exc:  # noqa: BLE001 - try the next candidate D
            errors.append(exc)
    if errors:
        raise errors[0]
    return gm


def _lora_as_linear(gm: fx.GraphModule) -> None:
    """``call_module`` of a LoRA layer → ``F.linear`` of its base layer's parameters (the adapters
    are added at call time)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        base = lora_base(gm.get_submodule(node.target))
        if base is None:
            continue
        with gm.graph.inserting_before(node):
            w = gm.graph.get_attr(f"{node.target}.base_layer.weight")
            b = gm.graph.get_attr(f"{node.target}.base_layer.bias") if base.bias is not None else None
            linear = gm.graph.call_function(F.linear, (node.args[0], w, b))
        node.replace_all_uses_with(linear)
        gm.graph.erase_node(node)
    gm.recompile()


def _input_features(gm: fx.GraphModule, x: fx.Node) -> list[int]:
    """Candidates for D: the input features of the linears that read the input (whatever the order
    the linears were declared), then of the others (the input may pass through other ops first)."""
    direct, others = [], []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (F.linear, torch._C._nn.linear) and len(node.args) > 1:
            weight = node.args[1]
            if isinstance(weight, fx.Node) and weight.op == "get_attr":
                (direct if node.args[0] is x else others).append(_attr(gm, weight.target).shape[-1])
    return list(dict.fromkeys(direct + others))


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _MetaValues(fx.Interpreter):
    """Example values on the meta device: parameters of any kind (DTensor too) become meta tensors
    of their full shape and dtype, so nothing real runs."""

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor):
            return torch.empty(tuple(value.shape), dtype=value.dtype, device="meta", requires_grad=value.requires_grad)
        return value

    def run_node(self, n: fx.Node):
        with torch.no_grad():
            value = super().run_node(n)
        n.meta["example_value"] = value
        return value


def _meta_values(gm: fx.GraphModule, x: torch.Tensor) -> None:
    """Run ``gm`` on meta tensors from the first input ``x``; nodes that need another input keep no
    value (the matcher still sees the FFN-like patterns among the others)."""
    interpreter = _MetaValues(gm, garbage_collect_values=False)
    for node in gm.graph.nodes:
        node.meta.pop("example_value", None)
    first = True
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if first:
                interpreter.env[node] = node.meta["example_value"] = x
                first = False
        elif node.op != "output" and all(n in interpreter.env for n in node.all_input_nodes):
            interpreter.env[node] = interpreter.run_node(node)


def _is_whole_forward(gm: fx.GraphModule, m: FfnMatch) -> bool:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return output.args[0] is m.down.out and m.x.op == "placeholder"


def _roles(m: FfnMatch) -> Optional[Roles]:
    """The child module of each projection (``gate_proj.weight`` → ``gate_proj``), or None if a
    weight is not a direct child's (the patched forward reads children)."""

    def child(proj) -> Optional[str]:
        if proj is None:
            return None
        node = proj.weight
        if node.op != "get_attr":
            return ""
        parts = node.target.split(".")
        if parts[-1] != "weight" or len(parts) not in (2, 4) or (len(parts) == 4 and parts[1] != "base_layer"):
            return ""
        return parts[0]

    names = tuple(child(p) for p in (m.gate, m.up, m.down))
    if "" in names:
        return None
    biases = ",".join(role for role, proj in zip(ROLES, (m.gate, m.up, m.down)) if proj is not None and proj.bias is not None)
    return Roles(names, m.kind, biases or "none", m.gate_activation)


def hidden_width(mod: nn.Module, roles: Roles) -> int:
    """H of a patched FFN module: the outputs of its up projection."""
    up = getattr(mod, roles.children[1])
    return (up if isinstance(up, nn.Linear) else lora_base(up)).out_features


def dtype_name(mod: nn.Module) -> str:
    return str(next(mod.parameters()).dtype).replace("torch.", "")
