"""Find ReLU FFNs in a torch-level FX graph (Dynamo's, or ``torch.fx.symbolic_trace``'s).

The matcher starts from every ReLU whose input is a linear projection (an "FFN-like" pattern) and
walks forward (SiLU and GELU gates are matched the same way, and rewritten as ReLU only with
``relu_gate=True``; otherwise a whole SiLU/GELU FFN is reported as skipped, naming the option):

* gated: ``down(relu(gate(x)) * up(x))`` with the product's operands in either order;
* plain: ``down(relu(up(x)))``.

A projection is ``F.linear(x, W[, b])``, ``x @ W.T``, ``torch.matmul(x, W.t())`` (any transpose
spelling), optionally followed by ``+ b``. Every intermediate node must have exactly one user, so
removing the pattern cannot change anything else in the graph. The matcher only reads the graph:
it returns a ``FfnMatch`` or a ``Skipped`` reason, never raises and never edits.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import fx

from .reporting import SkipReason, Skipped

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Spellings, each named for where it comes from.
_LINEAR_FNS = {torch._C._nn.linear, F.linear}  # nn.Linear / F.linear (Dynamo shows torch._C._nn.linear)
_MATMUL_FNS = {operator.matmul, torch.matmul}  # x @ W.T, torch.matmul(x, W.t())
_RELU_FNS = {torch.relu, torch.relu_, F.relu, torch.nn.functional.relu_}  # torch.relu, F.relu, nn.ReLU(inplace=True) inlined
_RELU_METHODS = {"relu", "relu_"}  # x.relu()
# Gates that relu_gate=True turns into ReLU: HF's ACT2FN "silu"/"swish" (F.silu), "gelu" and
# "gelu_pytorch_tanh" (F.gelu, exact or tanh), as Llama, Mistral, Qwen and Gemma configure them.
_OTHER_GATES = {F.silu: "SiLU", torch._C._nn.gelu: "GELU", F.gelu: "GELU"}
_OTHER_GATE_MODULES = {torch.nn.SiLU: "SiLU", torch.nn.GELU: "GELU"}
_OTHER_GATE_METHODS = {"silu": "SiLU"}
_MUL_FNS = {operator.mul, torch.mul}  # a * b, torch.mul(a, b)
_ADD_FNS = {operator.add, torch.add}  # x @ W.T + b
_TRANSPOSE_ATTRS = {"T", "mT"}  # W.T, W.mT (getattr nodes)


def example_value(node: object):
    """The example value Dynamo (or our meta pass) stored on a node, if any."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return None


def _is_tensor_node(node: object, ndim: Optional[int] = None) -> bool:
    v = example_value(node)
    return isinstance(v, torch.Tensor) and (ndim is None or v.dim() == ndim)


def is_relu(node: fx.Node, gm: Optional[fx.GraphModule] = None) -> Optional[fx.Node]:
    """The ReLU's input if ``node`` is a ReLU in any spelling, else None."""
    if node.op == "call_function" and node.target in _RELU_FNS and node.args:
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    if node.op == "call_method" and node.target in _RELU_METHODS:
        return node.args[0]
    if node.op == "call_module" and gm is not None:  # symbolic_trace with nn.ReLU as a leaf
        mod = gm.get_submodule(node.target)
        if isinstance(mod, torch.nn.ReLU):
            return node.args[0]
    return None


def activation(node: fx.Node, gm: Optional[fx.GraphModule] = None) -> Optional[tuple[fx.Node, str]]:
    """``(input, name)`` if ``node`` is a ReLU (``"ReLU"``) or a SiLU/GELU gate in any spelling."""
    pre = is_relu(node, gm)
    if pre is not None:
        return pre, "ReLU"
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_function" and node.target in _OTHER_GATES:
        return node.args[0], _OTHER_GATES[node.target]
    if node.op == "call_method" and node.target in _OTHER_GATE_METHODS:
        return node.args[0], _OTHER_GATE_METHODS[node.target]
    if node.op == "call_module" and gm is not None:
        name = _OTHER_GATE_MODULES.get(type(gm.get_submodule(node.target)))
        if name is not None:
            return node.args[0], name
    return None


def _mul_operands(node: fx.Node) -> Optional[tuple[object, object]]:
    if node.op == "call_function" and node.target in _MUL_FNS and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    if node.op == "call_method" and node.target == "mul" and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    return None


def _untransposed(node: object) -> Optional[fx.Node]:
    """``W`` if ``node`` is a transpose of a 2-D ``W`` in any spelling (``W.T``, ``W.t()``, ...)."""
    if not isinstance(node, fx.Node):
        return None
    base = None
    if node.op == "call_function" and node.target is getattr and node.args[1] in _TRANSPOSE_ATTRS:
        base = node.args[0]
    elif node.op == "call_method" and node.target == "t" and len(node.args) == 1:
        base = node.args[0]
    elif node.op == "call_function" and node.target is torch.t and len(node.args) == 1:
        base = node.args[0]
    elif (node.op == "call_method" and node.target == "transpose") or (node.op == "call_function" and node.target is torch.transpose):
        if len(node.args) == 3 and {node.args[1], node.args[2]} in ({0, 1}, {-1, -2}, {0, -1}, {-2, 1}):
            base = node.args[0]
    if isinstance(base, fx.Node) and _is_tensor_node(base, 2):
        return base
    return None


@dataclass
class Projection:
    """A node computing ``x Wᵀ (+ b)`` with ``W`` in ``nn.Linear`` layout ``[N, K]``."""

    out: fx.Node  # the node whose value is the projection
    x: fx.Node
    weight: fx.Node
    bias: Optional[fx.Node]
    internal: list[fx.Node] = field(default_factory=list)  # nodes the projection owns (out included)


def as_projection(node: object) -> Optional[Projection]:
    """Recognise a linear projection ending at ``node``, or None."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    if node.op == "call_function" and node.target in _LINEAR_FNS:
        x = node.args[0] if node.args else node.kwargs.get("input")
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if isinstance(x, fx.Node) and isinstance(w, fx.Node) and (b is None or isinstance(b, fx.Node)):
            return Projection(node, x, w, b, [node])
        return None
    is_matmul = (node.op == "call_function" and node.target in _MATMUL_FNS) or (node.op == "call_method" and node.target == "matmul")
    if is_matmul and len(node.args) == 2 and not node.kwargs:
        x, wt = node.args
        w = _untransposed(wt)
        if isinstance(x, fx.Node) and w is not None:
            internal = [node] + ([wt] if len(wt.users) == 1 else [])
            return Projection(node, x, w, None, internal)
        return None
    is_add = (node.op == "call_function" and node.target in _ADD_FNS) or (node.op == "call_method" and node.target == "add")
    if is_add and len(node.args) == 2 and not node.kwargs:
        for inner, bias in (node.args, node.args[::-1]):
            proj = as_projection(inner)
            # A multi-user inner product still makes this FFN-like; the single-user check reports it.
            if proj is not None and proj.bias is None and _is_tensor_node(bias, 1):
                return Projection(node, proj.x, proj.weight, bias, proj.internal + [node])
    return None


@dataclass
class FfnMatch:
    """One FFN: ``down(relu(gate(x)) * up(x))`` (gated) or ``down(relu(up(x)))`` (plain)."""

    x: fx.Node
    gate: Optional[Projection]
    up: Projection
    down: Projection
    act: fx.Node  # the ReLU node
    hidden: fx.Node  # h: the product (gated) or the ReLU (plain)
    compute_dtype: torch.dtype  # dtype of the projections' outputs (the autocast dtype under autocast)
    training: bool  # the output requires grad: pick the training op
    gate_activation: str = "ReLU"  # what the model computes there; anything else is rewritten only with relu_gate

    @property
    def kind(self) -> str:
        return "plain" if self.gate is None else "gated"

    def nodes_to_remove(self) -> list[fx.Node]:
        """Every node the rewrite makes dead, consumers first."""
        nodes = list(self.down.internal[::-1])
        if self.gate is not None:
            nodes.append(self.hidden)
        nodes.append(self.act)
        for proj in (self.up, self.gate):
            if proj is not None:
                nodes.extend(proj.internal[::-1])
        return nodes


def where(node: fx.Node) -> str:
    """A readable location: the module path of the FFN if known, else the source line."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, mod_type = list(stack.values())[-1]
        path = _readable_path(str(path))
        if isinstance(mod_type, type) and _is_leaf_of_ffn(mod_type) and "." in path:
            path = path.rsplit(".", 1)[0]  # a projection's or an activation's parent is the FFN module
        return path
    trace = node.meta.get("stack_trace")
    if trace:
        lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File")]
        if lines:
            return lines[-1]
    return node.name


_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")  # nn.ReLU, HF's ACT2FN classes


def _is_leaf_of_ffn(mod_type: type) -> bool:
    return issubclass(mod_type, torch.nn.Linear) or mod_type.__module__ in _ACTIVATION_MODULES


def _readable_path(path: str) -> str:
    """Dynamo's source of a module as a dotted path: ``L['self'].a.b`` → ``a.b``, and a wrapper's
    ``__dict__['_modules']['base_model']`` (PEFT) → ``base_model``."""
    path = re.sub(r"^L\['[^']*'\](\[\d+\])?\.?", "", path)
    path = re.sub(r"(?:__dict__\[')?_modules'?\]?\['([^']+)'\]", r"\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return re.sub(r"\.{2,}", ".", path).strip(".") or "model"


def _single_user(nodes: list[fx.Node], final: fx.Node) -> Optional[fx.Node]:
    """The first node (other than ``final``) with more than one user, if any."""
    for n in nodes:
        if n is not final and len(n.users) != 1:
            return n
    return None


def match_at_relu(act: fx.Node, gm: Optional[fx.GraphModule] = None) -> Union[FfnMatch, Skipped, None]:
    """Match the FFN around the activation ``act``: an ``FfnMatch``, a ``Skipped``, or None (not
    FFN-like). A SiLU/GELU gate gives a match only where the whole FFN is there (its
    ``gate_activation`` says which); its near misses are not FFN-like (those activations have
    other uses)."""
    found = activation(act, gm)
    if found is None:
        return None
    pre, gate_activation = found
    first = as_projection(pre)
    loc = where(act)
    if first is None:
        if gate_activation != "ReLU":
            return None
        if _projection_plus_term(pre):
            return Skipped(loc, SkipReason.EXTRA_TERM, f"{act.name}'s input {getattr(pre, 'name', pre)} adds a term to a projection")
        sharded = _sharded_projection(pre)
        if sharded is not None:
            return Skipped(loc, SkipReason.TENSOR_PARALLEL, f"{act.name} reads {sharded.out.name} through DTensor layout changes")
        if isinstance(pre, fx.Node) and pre.op == "placeholder" and _feeds_rest_of_ffn(act):
            return Skipped(loc, SkipReason.GRAPH_SPLIT, f"{act.name}'s input {pre.name} comes from an earlier graph")
        return None
    result = _match_from(act, first, loc, gm)
    if isinstance(result, FfnMatch):
        result.gate_activation = gate_activation
        return result
    return result if gate_activation == "ReLU" else None


def _projection_plus_term(node: object) -> bool:
    """``projection + something that is not a bias``, perhaps cast: a LoRA-adapted linear, PEFT's
    ``(base(x) + B(A(x))·s).to(dtype)``."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("to", "float", "type_as"):
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or len(node.args) != 2:
        return False
    is_add = node.target in _ADD_FNS or node.target in ("add", "add_") or node.target is operator.iadd
    return is_add and any(as_projection(a) is not None for a in node.args) and not any(_is_tensor_node(a, 1) for a in node.args)


# DTensor layout changes around a tensor-parallel linear (parallelize_module's hooks).
_DTENSOR_METHODS = {"to_local", "redistribute", "wait"}


def _sharded_projection(node: object) -> Optional[Projection]:
    """A projection of DTensors that ``node`` reads through layout changes (``to_local``,
    ``redistribute``), as tensor-parallel linears produce their local outputs."""
    peeled = False
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _DTENSOR_METHODS and node.args:
        node, peeled = node.args[0], True
    proj = as_projection(node) if peeled else None
    if proj is None or not type(example_value(proj.weight)).__name__ == "DTensor":
        return None
    return proj


def _adapted_down(hidden: fx.Node) -> bool:
    """``hidden`` feeds a down projection that is ``x·Wᵀ + b`` plus another term of ``hidden``
    (a LoRA-adapted down projection: ``base(h) + B(A(h))·s``)."""
    for user in hidden.users:
        proj = as_projection(user)
        if proj is not None and len(user.users) == 1 and _projection_plus_term(next(iter(user.users))):
            return True
    return False


def _feeds_rest_of_ffn(act: fx.Node) -> bool:
    """Whether ``act`` (whose input came from another graph) goes on as an FFN would: into a
    product with a projection, then a down projection, or straight into a down projection."""
    if len(act.users) != 1:
        return False
    (user,) = act.users
    operands = _mul_operands(user)
    if operands is not None:
        other = operands[1] if operands[0] is act else operands[0]
        if as_projection(other) is None or len(user.users) != 1:
            return False
        (user,) = user.users
    down = as_projection(user)
    return down is not None and down.x is (act if operands is None else next(iter(act.users)))


def _match_from(act: fx.Node, first: "Projection", loc: str, gm) -> Union[FfnMatch, Skipped]:
    def skip(reason: SkipReason, detail: str = "") -> Skipped:
        return Skipped(loc, reason, detail)

    if len(first.out.users) != 1:
        return skip(SkipReason.MULTI_USER, f"{first.out.name} feeds {len(first.out.users)} nodes")
    if len(act.users) != 1:
        if _adapted_down(act):
            return skip(SkipReason.EXTRA_TERM, f"{act.name} feeds a projection and another term")
        return skip(SkipReason.MULTI_USER, f"{act.name} feeds {len(act.users)} nodes")
    (user,) = act.users
    operands = _mul_operands(user)
    if operands is not None:
        other = operands[1] if operands[0] is act else operands[0]
        gate, up, hidden = first, as_projection(other), user
        if up is None:
            if isinstance(other, fx.Node) and other.op == "placeholder" and _is_tensor_node(other) \
                    and example_value(other).shape == example_value(act).shape:
                return skip(SkipReason.GRAPH_SPLIT, f"{act.name} is multiplied by {other.name}, from an earlier graph")
            if _projection_plus_term(other):
                return skip(SkipReason.EXTRA_TERM, f"{act.name} is multiplied by {other.name}, a projection plus a term")
            if _sharded_projection(other) is not None:
                return skip(SkipReason.TENSOR_PARALLEL, f"{act.name} is multiplied by {other.name}")
            return skip(SkipReason.NOT_AN_UP_PROJECTION, f"{act.name} is multiplied by {getattr(other, 'name', other)!r}")
        if up.x is not gate.x:
            return skip(SkipReason.NOT_AN_UP_PROJECTION, f"gate reads {gate.x.name}, up reads {up.x.name}")
        if len(up.out.users) != 1:
            return skip(SkipReason.MULTI_USER, f"{up.out.name} feeds {len(up.out.users)} nodes")
        if len(hidden.users) != 1:
            if _adapted_down(hidden):
                return skip(SkipReason.EXTRA_TERM, f"{hidden.name} feeds a projection and another term")
            return skip(SkipReason.MULTI_USER, f"{hidden.name} feeds {len(hidden.users)} nodes")
        (down_node,) = hidden.users
    else:
        gate, up, hidden, down_node = None, first, act, user
    down = as_projection(down_node)
    if down_node.op == "output":
        return skip(SkipReason.GRAPH_SPLIT, f"{hidden.name} is an output of this graph")
    if down is None or down.x is not hidden:
        return skip(SkipReason.NO_DOWN_PROJECTION, f"{hidden.name} feeds {down_node.name}")
    for proj in (gate, up, down):
        if proj is not None:
            bad = _single_user(proj.internal, proj.out)
            if bad is not None:
                return skip(SkipReason.MULTI_USER, f"{bad.name} feeds {len(bad.users)} nodes")
    return _check_tensors(FfnMatch(up.x, gate, up, down, act, hidden, torch.float32, False), skip)


def _check_tensors(m: FfnMatch, skip) -> Union[FfnMatch, Skipped]:
    """Shapes, dtypes and devices from the nodes' example values."""
    x, up_w, down_w = example_value(m.x), example_value(m.up.weight), example_value(m.down.weight)
    out = example_value(m.down.out)
    if not all(isinstance(t, torch.Tensor) for t in (x, up_w, down_w, out)):
        return skip(SkipReason.NOT_A_WEIGHT, "no example values on the nodes")
    for name, proj in (("gate", m.gate), ("up", m.up), ("down", m.down)):
        if proj is not None and not _is_tensor_node(proj.weight, 2):
            return skip(SkipReason.NOT_A_WEIGHT, f"{name} weight {proj.weight.name}")
    hidden, d_model = up_w.shape
    shapes = [(m.up.weight, (hidden, d_model)), (m.down.weight, (d_model, hidden)), (m.up.bias, (hidden,)), (m.down.bias, (d_model,))]
    if m.gate is not None:
        shapes += [(m.gate.weight, (hidden, d_model)), (m.gate.bias, (hidden,))]
    for node, shape in shapes:
        if node is not None and tuple(example_value(node).shape) != shape:
            return skip(SkipReason.SHAPE_MISMATCH, f"{node.name} is {tuple(example_value(node).shape)}, expected {shape}")
    if x.dim() < 1 or x.shape[-1] != d_model:
        return skip(SkipReason.SHAPE_MISMATCH, f"input {m.x.name} is {tuple(x.shape)}, weights need D={d_model}")
    compute = out.dtype
    projections = [p for p in (m.gate, m.up, m.down) if p is not None]
    if any(example_value(p.out).dtype != compute for p in projections):
        return skip(SkipReason.MIXED_DTYPES, "the projections produce different dtypes")
    if compute not in SUPPORTED_DTYPES:
        return skip(SkipReason.UNSUPPORTED_DTYPE, str(compute))
    tensors = [x] + [example_value(n) for p in projections for n in (p.weight, p.bias) if n is not None]
    if len({t.device for t in tensors}) != 1:
        return skip(SkipReason.MIXED_DEVICES, ", ".join(sorted({str(t.device) for t in tensors})))
    # Outside autocast, eager F.linear refuses an input and a weight of different dtypes; the
    # graph is left as traced, so that the compiled code fails where eager does.
    if len({t.dtype for t in tensors}) != 1 and not _autocast_active(m, x.device.type):
        return skip(SkipReason.MIXED_DTYPES, ", ".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors})))
    m.compute_dtype = compute
    m.training = bool(out.requires_grad)
    return m


def _autocast_active(m: FfnMatch, device_type: str) -> bool:
    """Whether autocast applies to the FFN: enabled around the compile (Dynamo guards on it) or
    entered inside the traced code."""
    if torch.is_autocast_enabled(device_type):
        return True
    graph = m.down.out.graph
    return any(n.op == "call_function" and "autocast" in getattr(n.target, "__name__", "") for n in graph.nodes)


def find_ffns(gm: fx.GraphModule) -> tuple[list[FfnMatch], list[Skipped]]:
    """Every FFN in ``gm`` and every FFN-like pattern left alone. Reads only; never raises."""
    matches: list[FfnMatch] = []
    skipped: list[Skipped] = []
    for node in list(gm.graph.nodes):
        try:
            if activation(node, gm) is None:
                continue
            result = match_at_relu(node, gm)
        except Exception as exc:  # noqa: BLE001 - the matcher must never crash a compile
            result = Skipped(where(node), SkipReason.INTERNAL_ERROR, repr(exc))
        if isinstance(result, FfnMatch):
            matches.append(result)
        elif isinstance(result, Skipped):
            skipped.append(result)
    return matches, skipped
