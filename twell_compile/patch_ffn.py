"""Eager rewrite of FFN modules, for scripts that never compile and for DDP.

``patch(model)`` finds each module whose whole forward is one FFN (``module_ffn.py``: traced with
``torch.fx`` and decided by the same matcher as the compile routes) and gives it a ``forward``
that calls the TwELL op.

A patched module stays an ordinary module (``docs/usage.md``, "Patched modules"):

* its forward is ``functools.partial(patched_forward, module)``, and its patch state an
  attribute, so ``copy.deepcopy``, pickle and ``torch.save`` work, and a copy computes with its
  own weights;
* everything is read at call time: the projections' parameters (FSDP swaps Parameter objects, and
  ``load_state_dict``, ``.to()`` and optimizers change them), grad mode, autocast, and the
  module's ``training`` flag (a forward that branches on it is traced again in the other mode);
* a projection replaced after patching (a PEFT LoRA layer) has its adapters merged at call time,
  ``W + scaling · B A`` (exact: gradients reach A and B through autograd), where that is the
  layer's function (no dropout while training, no DoRA); anything else runs the module's own
  forward, and the report and a warning say why. So does a projection whose call does more than
  its forward (its own hooks, a forward replaced on the instance as accelerate's hooks do, or
  global module hooks), which the op, reading its weights, would bypass;
* its layer (id, full name, model) is registered under the patched model (after a copy or an
  unpickle, or when ``TWELL=1``'s ``torch.compile`` wrapper patched one block of the model: on its
  first call, under the model on the stack, as the compile routes do), so the L1 term is the same
  mean over the model's layers on every route; a module called twice in one forward adds two L1
  terms, on every route.

A module that looks like an FFN but cannot be replaced (its forward takes more than one input, or
does more than the FFN) is reported with the reason, never left alone in silence.

Under DDP with ``torch.compile``, DDPOptimizer splits Dynamo graphs at bucket boundaries, usually
inside an FFN; a patched FFN is a single op, so it stays whole (docs/architecture.md, "TWELL=1").
"""

from __future__ import annotations

import copy
import functools
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from . import density_control, layers, lowering, loss_scaling_hooks, reporting
from .announcement import announce
from .l1 import forward_value
from .module_ffn import ROLES, Roles, dtype_name, examine, hidden_width, is_candidate, lora_base
from .module_paths import ModelIndex, calling_model, clean_path, display_name, gathers_weights, unwrap
from .options import TwellOptions
from .reporting import Rewritten, SkipReason, Skipped

STATE_ATTR = "_twell_ffn"


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
        **options: as for the backend (``l1_coeff``, ``target_density``, ``l1_coeff_max``,
            ``relu_gate``, ``strict``; ``inner`` and ``mode`` are ignored).

    Returns:
        A ``PatchResult`` with the rewritten modules and the FFN-like ones left alone.

    Example::

        >>> result = twell_compile.patch(model, l1_coeff=2e-5)
        >>> print(result)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"twell: patch(model) needs a torch.nn.Module, got {type(model).__name__}")
    result, _ = patch_modules(model, TwellOptions.from_dict(options))
    return result


def patch_modules(model: nn.Module, opts: TwellOptions, *, register_on_call: bool = False,
                  warn: bool = True) -> tuple[PatchResult, list[nn.Module]]:
    """``patch`` with validated options; returns the result and the modules it patched.

    ``register_on_call`` (TWELL=1's compile wrapper, handed a module that may be one decoder block
    of the model): the patched modules' layers are registered and reported on their first call,
    under the model then calling them (``register_waiting``), not under ``model``. ``warn=False``:
    no nothing-rewritten warning (the compile route may still rewrite what patch cannot)."""
    loss_scaling_hooks.install()
    result = PatchResult()
    found = []
    root = unwrap(model)
    for name, mod in root.named_modules():
        if STATE_ATTR in mod.__dict__ or not is_candidate(mod):
            continue
        path = clean_path(name)
        where = display_name(root, path)
        # Both training modes now: a forward may branch on self.training, and tracing at call time
        # would be a side effect inside a compiled region.
        roles, skips = {}, {}
        for mode in (mod.training, not mod.training):
            roles[mode], skips[mode] = examine(mod, where, mode, opts.relu_gate)
        if any(r is not None for r in roles.values()):
            found.append((path, where, mod, roles))  # the other mode, if it differs, runs the module's own forward
        else:
            result.skipped.extend(skips[mod.training])
    if opts.strict and result.skipped:
        from .rewrite_ffn import TwellRewriteError

        details = "\n".join(f"  - {s}" for s in result.skipped)
        raise TwellRewriteError(f"twell (strict=True): {len(result.skipped)} FFN-like pattern(s) cannot be patched:\n{details}")
    for path, where, mod, roles in found:
        state = FFNPatch(where, opts, roles, mod.__dict__.get("forward"))
        kind = roles[mod.training] or roles[not mod.training]
        op = "twell::ffn / ffn_train (patched)" + (f", {kind.gate_activation} gate as ReLU" if kind.gate_activation != "ReLU" else "")
        state.unreported = (kind.kind, kind.biases, dtype_name(mod), op)
        if register_on_call:
            _waiting[mod] = (weakref.ref(root), path)
        else:
            result.rewritten.append(state.register(mod, root, path, next(mod.parameters()).device))
        mod.__dict__[STATE_ATTR] = state
        mod.forward = functools.partial(patched_forward, mod)
    reporting.record(result.rewritten, result.skipped)
    # Only a model none of whose FFNs is patched (now or by an earlier call) lacks its L1 term.
    if warn and result.skipped and not found and not any(STATE_ATTR in m.__dict__ for m in root.modules()):
        reporting.warn_unrewritten(type(root).__name__, id(root), result.skipped, "patch()", stacklevel=4)
    return result, [mod for _, _, mod, _ in found]


# Modules patched with ``register_on_call``, waiting for their first call: module -> (weak
# reference to the module patch() was handed, path in it).
_waiting: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def waiting_modules() -> list[nn.Module]:
    return list(_waiting.keys())


def register_waiting(model: Optional[nn.Module], modules=()) -> list[Rewritten]:
    """Register every waiting layer that is part of ``model`` under its full path there, all at
    once, so the model's L1 mean counts them all from its first step; then those of ``modules``
    that are not part of it, under the module patch() was handed. Returns them as reported."""
    if not _waiting:
        return []
    done = []
    index = ModelIndex(model) if model is not None else None
    for module in list(_waiting.keys()):
        path = index.module_path(module) if index is not None else None
        if path is not None and _waiting.pop(module, None) is not None:
            done.append(module.__dict__[STATE_ATTR].register(module, model, path, next(module.parameters()).device))
    for module in modules:
        entry = _waiting.pop(module, None)
        if entry is not None:
            root = entry[0]()
            identity = entry[1] if root is not None else ("module", id(module))
            done.append(module.__dict__[STATE_ATTR].register(module, root, identity, next(module.parameters()).device))
    done = [r for r in done if r is not None]
    reporting.record(done, [], graphs=0)
    return done


# ---------------------------------------------------------------------------------------------
# The patched forward
# ---------------------------------------------------------------------------------------------


class FFNPatch:
    """What a patched module keeps: its roles per training mode, and (rebuilt on first use, never
    copied or pickled) its layer and coefficient tensors."""

    def __init__(self, where: str, options: TwellOptions, roles: dict, original_forward=None):
        self.where = where
        self.options = options
        self.l1_coeff = options.l1_coeff
        self.roles = roles  # {training flag: Roles or None}
        self.original_forward = original_forward
        self._reset_runtime()

    _RUNTIME = ("layer", "coefficients", "factors", "warned", "unreported")

    def _reset_runtime(self) -> None:
        self.layer: Optional[layers.Layer] = None
        self.coefficients: dict[str, torch.Tensor] = {}  # str(device) -> live L1 coefficient
        self.factors: dict[str, torch.Tensor] = {}  # str(device) -> the model's live L1 factor
        self.warned: set = set()
        self.unreported: Optional[tuple] = None  # (kind, biases, dtype, op) until the first registration reports it

    def __getstate__(self):
        state = dict(self.__dict__)
        for key in self._RUNTIME:
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_runtime()

    def __deepcopy__(self, memo):
        clone = FFNPatch.__new__(FFNPatch)
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone

    def roles_for(self, module: nn.Module) -> Optional[Roles]:
        """The roles in the module's current training mode (both were traced by ``patch``)."""
        roles = self.roles.get(module.training)
        if roles is None:
            mode = "training" if module.training else "eval"
            self._fall_back(module, f"in {mode} mode its forward is not one FFN the op computes")
        return roles

    def register(self, module: nn.Module, model: Optional[nn.Module], identity, device: torch.device) -> Optional[Rewritten]:
        """The layer under ``model``; the first registration returns the report's entry for it."""
        name = display_name(model, identity) if isinstance(identity, str) else self.where
        roles = next(r for r in self.roles.values() if r is not None)
        self.layer = layers.register(model, identity, name, device, hidden=hidden_width(module, roles), l1_coeff=self.l1_coeff)
        if model is not None and gathers_weights(model):  # FSDP2: no per-weight cache outlives a reshard
            lowering.mark_gathered_weight_layers([self.layer.id])
        opts = self.options
        density_control.control(self.layer.model, opts.target_density, opts.l1_coeff, opts.l1_coeff_max)
        self.factors = {}
        self.coefficients = {}
        self._ensure_device(device)
        if self.unreported is None:
            return None
        self.where = name
        kind, biases, dtype, op = self.unreported
        self.unreported = None
        return Rewritten(self.layer.id, name, kind, biases, dtype, op, "patch")

    def _ensure_device(self, device: torch.device) -> None:
        """The layer's telemetry, L1 factor and coefficient on ``device``, made outside the forward
        (inside a compiled region making them would be a side effect)."""
        key = str(device)
        if key not in self.coefficients:
            lowering.telemetry.ensure(self.layer.id, device, self.layer.hidden)
            self.factors[key] = layers.factor(self.layer.model, device)
            self.coefficients[key] = self.layer.coefficient(device)

    @torch._dynamo.disable
    def register_from_stack(self, module: nn.Module, device: torch.device) -> None:
        """On the first call after a copy or an unpickle, or of a module patched with
        ``register_on_call``: the layer under the model calling it (the modules on the stack)."""
        model = calling_model()
        if module in _waiting:
            announce(register_waiting(model, [module]), [])
            return
        path = ModelIndex(model).module_path(module) if model is not None else None
        self.register(module, model if path is not None else None, path if path is not None else ("module", id(module)),
                      device)

    @torch._dynamo.disable
    def moved_to(self, device: torch.device) -> None:
        self._ensure_device(device)

    def _fall_back(self, module: nn.Module, why: str) -> None:
        if why in self.warned:
            return
        self.warned.add(why)
        reporting.record([], [Skipped(self.where, SkipReason.PATCH_FALLBACK, why, "patch")], graphs=0)
        warnings.warn(f"twell: {self.where} runs its own forward, without the TwELL op or its L1 term: {why}",
                      RuntimeWarning, stacklevel=4)

    def run_original(self, module: nn.Module, x, *args, **kwargs):
        if self.original_forward is not None:
            return self.original_forward(x, *args, **kwargs)
        return type(module).forward(module, x, *args, **kwargs)


def patched_forward(module: nn.Module, x, *args, **kwargs):
    """A patched FFN module's forward: the TwELL op on the module's current parameters."""
    state: FFNPatch = module.__dict__[STATE_ATTR]
    roles = state.roles_for(module) if not (args or kwargs) and isinstance(x, torch.Tensor) else None
    params = None if roles is None else _parameters(state, module, roles)
    if params is None:
        return state.run_original(module, x, *args, **kwargs)
    if state.layer is None:
        state.register_from_stack(module, x.device)
    key = str(x.device)
    if key not in state.coefficients:
        state.moved_to(x.device)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):  # F.linear would run in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        x = x.to(dtype)
        params = [None if t is None else t.to(dtype) for t in params]
    wg, wu, wd, bg, bu, bd = params
    layer = state.layer.id
    if torch.is_grad_enabled() and (x.requires_grad or any(t is not None and t.requires_grad for t in params)):
        coefficient = state.coefficients[key]
        # The value for this forward's backward: the graph's own snapshot op when compiled, else
        # a snapshot made once per change of the coefficient (l1.py).
        coeff = lowering.l1_snapshot(coefficient) if torch.compiler.is_compiling() else forward_value(coefficient)
        return torch.ops.twell.ffn_train(x, wg, wu, wd, bg, bu, bd, coeff, state.factors[key], layer)[0]
    return torch.ops.twell.ffn(x, wg, wu, wd, bg, bu, bd, layer)


def _parameters(state: FFNPatch, module: nn.Module, roles: Roles) -> Optional[list]:
    """``[wg, wu, wd, bg, bu, bd]`` read now from the projections (LoRA adapters merged), or None
    (after a fall-back has been recorded) when one is no longer a linear the op can take."""
    if _global_hooks():
        state._fall_back(module, "global module hooks are registered, which the op would bypass in its projections")
        return None
    weights, biases = {}, {}
    for role, name in zip(ROLES, roles.children):
        if name is None:
            weights[role] = biases[role] = None
            continue
        child = getattr(module, name, None)
        found = _linear_parameters(child, module.training)
        if isinstance(found, str):
            state._fall_back(module, f"its {name} is {found}")
            return None
        weights[role], biases[role] = found
    return [weights["gate"], weights["up"], weights["down"], biases["gate"], biases["up"], biases["down"]]


def _linear_parameters(child, training: bool):
    """``(weight, bias)`` of an ``nn.Linear`` or of a LoRA layer with its adapters merged; a string
    saying why not otherwise."""
    if type(child) is nn.Linear or (isinstance(child, nn.Linear) and type(child).forward is nn.Linear.forward):
        return _hooked(child) or (child.weight, child.bias)
    base = lora_base(child) if isinstance(child, nn.Module) else None
    if base is None:
        return f"a {type(child).__name__}, not an nn.Linear"
    hooked = next((h for h in map(_hooked, child.modules()) if h), None)
    if hooked:
        return hooked
    if getattr(child, "merged", False) or getattr(child, "disable_adapters", False):
        return base.weight, base.bias
    weight = base.weight
    for name in getattr(child, "active_adapters", ()):
        if name not in child.lora_A:
            continue
        if getattr(child, "use_dora", {}).get(name, False) or getattr(child, "lora_bias", {}).get(name, False):
            return f"a LoRA layer with DoRA or a LoRA bias (adapter {name!r}), which cannot be merged"
        dropout = child.lora_dropout[name] if name in getattr(child, "lora_dropout", {}) else nn.Identity()
        if training and not isinstance(dropout, nn.Identity):
            return f"a LoRA layer with dropout while training (adapter {name!r}), which cannot be merged"
        delta = child.lora_B[name].weight @ child.lora_A[name].weight
        weight = weight + (delta * child.scaling[name]).to(weight.dtype)
    return weight, base.bias


def _hooked(child: nn.Module) -> Optional[str]:
    """Why calling ``child`` does more than its forward (the op reads its weights and would bypass
    that), or None."""
    if "forward" in child.__dict__:
        return f"a {type(child).__name__} whose forward is replaced on the instance (as accelerate's hooks do)"
    if child._forward_pre_hooks or child._forward_hooks or child._backward_pre_hooks or child._backward_hooks:
        return f"a {type(child).__name__} with forward or backward hooks"
    return None


def _global_hooks() -> bool:
    """Whether global module hooks other than twell's own (TWELL=1's first-call hook) are registered."""
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_backward_pre_hooks or hooks._global_backward_hooks:
        return True
    return any(not getattr(h, "_twell_internal", False) for h in hooks._global_forward_pre_hooks.values())
