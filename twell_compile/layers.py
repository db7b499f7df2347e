"""The rewritten layers: each one's id, name and model, and each model's L1 normalisation.

A *layer* is one FFN of one model, named by its full module path (``model.layers.3.mlp``). Every
route registers the FFNs it rewrites here (``register``): the compile routes once per graph that
holds them, the eager patch on a patched module's first call. A layer registered again (a
recompile, a second graph, a module called twice in one forward) keeps its id.

The L1 term is ``mean over the model's layers of L1_l`` (docs/architecture.md, "The L1
regularizer"), so each layer's injected gradient is weighted by ``1/n``, with ``n`` the number of
distinct layers of its model: counted per model, never per graph, so it does not depend on how
the model is compiled (whole, per decoder layer, cut by DDP buckets or graph breaks) or patched.
Each model keeps one live 0-d float32 tensor per device, its *L1 factor* ``S / n`` (``S``: the
loss scale of the backward in progress, ``loss_scaling.py``), which the training op reads in its
backward. Registering a layer rewrites the factor in place, so a graph compiled while its model's
other layers were still unknown (per-layer compile, during the first forward) still uses the
right ``n`` when its backward runs.

FFNs whose model cannot be told (a compiled function called from no module) share one group.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Hashable, Optional

import torch
from torch import nn

from . import loss_scaling
from .lowering import telemetry


@dataclass(eq=False)
class Layer:
    id: int  # telemetry and dispatch key (``stats()``)
    name: str  # full module path in its model
    model: "Model"
    hidden: int  # H, the FFN's hidden width
    l1_option: float  # the l1_coeff option it was last registered with
    coefficients: dict = field(default_factory=dict)  # str(device) -> live 0-d L1 coefficient

    def coefficient(self, device: torch.device | str) -> torch.Tensor:
        """The layer's live L1 coefficient on ``device`` (every graph and patch of it shares it)."""
        from .l1 import coefficient_tensor

        key = telemetry.device_key(device)
        t = self.coefficients.get(key)
        if t is None:
            t = self.coefficients[key] = coefficient_tensor(self.l1_option, device)
        return t


@dataclass(eq=False)
class Model:
    """One model's rewritten layers and its live L1 factors."""

    label: str
    index: int  # a small number that names its tensors in graphs
    _ref: Optional[weakref.ref] = None
    layers: dict = field(default_factory=dict)  # identity -> Layer
    factors: dict = field(default_factory=dict)  # str(device) -> live 0-d float32 tensor
    controller: Optional[object] = None  # density_control.DensityController, with target_density

    @property
    def module(self) -> Optional[nn.Module]:
        return None if self._ref is None else self._ref()

    @property
    def n_layers(self) -> int:
        return max(1, len(self.layers))


_lock = threading.RLock()
_models: dict[int, Model] = {}  # id(model) -> Model (checked against the weak reference)
_unowned = Model("(no module)", 0)
_layers: dict[int, Layer] = {}
_next_id = 0
_next_model = 0


def model_of(module: Optional[nn.Module]) -> Model:
    """The registry's entry for ``module`` (created on first use); the shared group for None."""
    if module is None:
        return _unowned
    with _lock:
        entry = _models.get(id(module))
        if entry is None or entry.module is not module:
            global _next_model
            _next_model += 1
            entry = Model(type(module).__name__, _next_model, weakref.ref(module))
            _models[id(module)] = entry
        return entry


def register(module: Optional[nn.Module], identity: Hashable, name: str, device: torch.device | str, *,
             hidden: int, l1_coeff: float) -> Layer:
    """The layer ``identity`` of ``module`` (the FFN's full path, or any key that tells its FFNs
    apart), registered if new; the model's L1 factor on ``device`` then counts it. Registered
    again with another ``l1_coeff`` option (a new compile with other options), its coefficient
    takes that value; with the same option it keeps its current value (set_l1_coeff's, or the
    density controller's), so a recompile does not reset it."""
    model = model_of(module)
    with _lock:
        layer = model.layers.get(identity)
        if layer is None:
            global _next_id
            layer = Layer(_next_id, name, model, hidden, l1_coeff)
            _next_id += 1
            model.layers[identity] = layer
            _layers[layer.id] = layer
            refresh_factors(model)
        elif layer.l1_option != l1_coeff:
            from .l1 import coefficient_tensor

            layer.l1_option = l1_coeff
            layer.coefficients = {key: coefficient_tensor(l1_coeff, key) for key in layer.coefficients}
        factor(model, device)
        layer.coefficient(device)
    return layer


def factor(model: Model, device: torch.device | str) -> torch.Tensor:
    """The model's live L1 factor on ``device`` (``S / n``), made at rewrite time: a real tensor
    even under a fake mode, and a normal one even under ``torch.inference_mode()``."""
    key = telemetry.device_key(device)
    with _lock:
        t = model.factors.get(key)
        if t is None:
            with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.inference_mode(False):
                t = torch.zeros((), dtype=torch.float32, device=device)
            model.factors[key] = t
            _write_factor(model, key, t)
        return t


def refresh_factors(model: Optional[Model] = None) -> None:
    """Rewrite the L1 factors (of one model, or of all) after ``n`` or the loss scale changed."""
    with _lock:
        models = [model] if model is not None else [_unowned, *_models.values()]
        for m in models:
            for key, t in m.factors.items():
                _write_factor(m, key, t)


def _write_factor(model: Model, device: str, t: torch.Tensor) -> None:
    # Through .data: a backward in flight holds these tensors, and must not see a version change.
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad(), torch.inference_mode(False):
        loss_scaling.write_scaled(t.data, 1.0 / model.n_layers, device)


loss_scaling.on_change(refresh_factors)


def layer(layer_id: int) -> Optional[Layer]:
    return _layers.get(layer_id)


def name_of(layer_id: int) -> str:
    entry = _layers.get(layer_id)
    return "?" if entry is None else entry.name


def reset() -> None:
    """Forget every layer and model (``twell_compile.reset()``). Ids are never reused: the ops keep
    per-layer state (dispatch counters) under them."""
    with _lock:
        _models.clear()
        _layers.clear()
        _unowned.layers.clear()
        _unowned.factors.clear()
