"""``target_density``: steer each layer's L1 coefficient to a density instead of fixing it.

How much sparsity a coefficient buys depends on the model's width, depth and the run (docs/
usage.md, "Training with the recipe"): 2e-5 makes the paper's 2048/5632 FFNs ~1% dense, and a
768/2048 model barely sparse. With ``target_density=d`` the user names the density and a
controller finds the coefficient, per layer, while the model trains.

After every optimizer step (a global ``torch.optim`` step post-hook), for each layer ``l`` of a
controlled model, on the device and with no host sync:

* the density ``ρ_l`` of the layer's last call is read from its telemetry buffer (active entries
  over tokens·H, which the ops' own kernels store), and smoothed: ``ρ̄ ← ρ̄ + β (ρ − ρ̄)``;
* the setpoint ``s_l(t)`` falls from the layer's first reading ``ρ_l(0)`` to the target ``d``
  along a cubic ramp of ``RAMP_STEPS`` steps (Zhu & Gupta's gradual pruning schedule), then stays
  at ``d``: ``s_l(t) = d + (ρ_l(0) − d) · (1 − min(1, t / RAMP_STEPS))³``;
* the coefficient moves in log space by the log-ratio to the setpoint, clipped:
  ``c_l ← clamp(c_l · exp(clamp(γ · log(ρ̄_l / s_l(t)), −r, r)), c_min, c_max)``.

Why the ramp: the density follows a change of coefficient only over tens to hundreds of steps.
Steering to the target at once kept the error large for that whole lag, so the coefficient
climbed at its limit long after enough was applied, overshot, and the language-model loss paid
for the excess. Following a setpoint that moves about as fast as the density can keeps the error,
and the climb, small.

Per layer, because layers differ by 10× in density at one coefficient (0.24–2.4% in one 6-layer
run), and a layer's path (sparse or dense) follows its own density: one coefficient for the model
would leave the densest layers on the dense path. The model's L1 term keeps its definition (a mean
over layers, each layer's term with its own coefficient).

Safety: from a dense start (a fresh ReLU model is ~50% dense) the coefficient can grow by at most
``exp(r)`` a step (2%: ×7 in 100 steps, ×50 in 200), and only as far as the setpoint asks; it
never exceeds ``l1_coeff_max`` (default ``1000 · max(l1_coeff, 2e-5)``). That ceiling bounds the
coefficient, hence the weight of the L1 term in the loss; nothing here bounds the language-model
loss itself.

Under ``torch.distributed`` (world size > 1) every rank steers on the density of the global batch:
the counters (calls, tokens, active entries) are summed over the default process group before the
density is computed, one small ``all_reduce`` per device and step, ordered on the stream (no host
sync with NCCL). Every rank then computes the same coefficients. The collective relies on all
ranks stepping their optimizer together with the same rewritten layers, as DDP and FSDP do.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

# Controller constants (per optimizer step). GAIN, MAX_STEP and SMOOTHING were chosen by reasoning;
# RAMP_STEPS from H200 runs (docs/benchmarks.md, "Training from scratch"): at 0, 500 and 800 a
# 768/2048 12-layer Llama ended 1000 steps at 0.58% / 0.68% / 1.09% density (target 0.5%); at 500
# the paper's 2048/5632 width reached 0.44% at step 500 and held 0.44-0.53%, +0.56% loss.
GAIN = 0.05  # γ: log-coefficient change per unit log density error
MAX_STEP = 0.02  # r: at most 2% a step, up or down
SMOOTHING = 0.2  # β: the density's moving average
RAMP_STEPS = 500  # steps over which each layer's setpoint falls from its first density to the target
MIN_COEFF = 1e-9  # c_min: a coefficient that reached 0 could never grow back multiplicatively
# The default l1_coeff_max, as a multiple of the start. At 100x (2e-3) a 768/2048 12-layer Llama
# stalled at 9% density after 600 steps (H200, bytes, 32 x 512 tokens a step); the fixed-
# coefficient runs reached 0.24% at 1e-3 only after 800-2000 steps and 0.03% at 5e-3.
CEILING = 1000.0

_lock = threading.Lock()
_controllers: "weakref.WeakSet[DensityController]" = weakref.WeakSet()
_hook = None


class DensityController:
    """One model's coefficient steering (``layers.Model.controller``)."""

    def __init__(self, target: float, max_coeff: float):
        self.target = target
        self.max_coeff = max_coeff
        self._state: dict[str, tuple] = {}  # str(device) -> (coefficients, buffers, hidden, smoothed, start)
        self._steps: dict[str, int] = {}  # str(device) -> controller steps since its state was gathered
        self._optimizers: dict[int, tuple] = {}  # id(optimizer) -> (weak reference, whether it trains the model)
        self._model_ref = None
        with _lock:
            _controllers.add(self)
            _install_hook()

    def attach(self, model) -> None:
        self._model_ref = weakref.ref(model)
        self._state.clear()

    def trains(self, optimizer) -> bool:
        """Whether ``optimizer`` updates this model (one update per step of the model's own
        optimizer, not of every optimizer in the process)."""
        key = id(optimizer)
        known = self._optimizers.get(key)
        if known is None or known[0]() is not optimizer:
            model = self._model_ref() if self._model_ref is not None else None
            module = model.module if model is not None else None
            if module is None:
                return True  # layers of no known module: every optimizer step updates them
            ids = {id(p) for p in module.parameters()}
            owns = any(id(p) in ids for group in optimizer.param_groups for p in group["params"][:1])
            known = self._optimizers[key] = (weakref.ref(optimizer), owns)
        return known[1]

    def step(self) -> None:
        """One update of every layer's coefficient, on the device (no host sync)."""
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            return
        from . import l1

        reduce = _distributed()
        for key, (coeffs, buffers, hidden, smoothed, start) in self._tensors(model).items():
            steps = self._steps[key] = self._steps.get(key, -1) + 1
            with torch.no_grad():
                counts = torch.stack(buffers)[:, :3]  # [n, 3]: each layer's calls, tokens, active entries
                if reduce:
                    counts = counts.contiguous()
                    torch.distributed.all_reduce(counts)  # the global batch's counters, on every rank
                tokens = counts[:, 1].clamp(min=1.0)
                density = (counts[:, 2] / (tokens * hidden)).float()
                seen = counts[:, 0] > 0
                moved = torch.where(smoothed.isnan(), density, smoothed + SMOOTHING * (density - smoothed))
                smoothed.data.copy_(torch.where(seen, moved, smoothed))  # the first reading starts the average
                start.data.copy_(torch.where(start.isnan() & seen, smoothed.clamp(min=self.target), start))
                setpoint = self.setpoint(start, steps)
                error = torch.log(smoothed.nan_to_num(self.target).clamp(min=1e-7) / setpoint)
                change = torch.exp((GAIN * error).clamp(-MAX_STEP, MAX_STEP))
                current = torch.stack(coeffs)
                new = torch.where(seen, (current * change).clamp(MIN_COEFF, self.max_coeff), current)
                torch._foreach_copy_([c.data for c in coeffs], list(new.unbind()))
        l1.changed()

    def setpoint(self, start: torch.Tensor, steps: int) -> torch.Tensor:
        """The density each layer is steered to after ``steps`` steps: from its first reading
        ``start`` down to the target along a cubic ramp of ``RAMP_STEPS`` (Zhu & Gupta's gradual
        pruning schedule), the target itself from then on."""
        left = max(0.0, 1.0 - steps / RAMP_STEPS) ** 3 if RAMP_STEPS > 0 else 0.0
        return (self.target + (start.nan_to_num(self.target) - self.target) * left).clamp(min=self.target)

    def _tensors(self, model) -> dict:
        """Per device: the layers' live coefficients and telemetry buffers, gathered once, and again
        when the model gains a layer or a device, or a layer's coefficient tensor is replaced (a
        recompile with another ``l1_coeff``): checked by identity, so the controller never steers
        tensors no graph reads."""
        from .lowering import telemetry

        live: dict[str, list] = {}  # in layer order, so every rank orders its collectives alike
        for layer in model.layers.values():
            for key, t in layer.coefficients.items():
                live.setdefault(key, []).append(t)
        if live.keys() != self._state.keys() or any(
                len(ts) != len(self._state[key][0]) or any(a is not b for a, b in zip(ts, self._state[key][0]))
                for key, ts in live.items()):
            self._state.clear()
            layers = list(model.layers.values())
            for key in live:
                present = [layer for layer in layers if key in layer.coefficients]
                coeffs = [layer.coefficients[key] for layer in present]
                buffers = [telemetry.buffer(layer.id, key) for layer in present]
                hidden = torch.tensor([float(layer.hidden) for layer in present], dtype=torch.float64, device=key)
                smoothed = torch.full((len(present),), float("nan"), dtype=torch.float32, device=key)
                self._state[key] = (coeffs, buffers, hidden, smoothed, smoothed.clone())
            self._steps.clear()
        return self._state


def _distributed() -> bool:
    """Whether the counters are summed over ranks: torch.distributed is up with more than one."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def control(model, target: Optional[float], l1_coeff: float, max_coeff: Optional[float]) -> None:
    """Give ``model`` (a ``layers.Model``) a controller for ``target`` (None: fixed coefficients)."""
    if target is None:
        return
    ceiling = max_coeff if max_coeff is not None else CEILING * max(l1_coeff, 2e-5)
    existing = getattr(model, "controller", None)
    if existing is not None and existing.target == target and existing.max_coeff == ceiling:
        return
    controller = DensityController(target, ceiling)
    controller.attach(model)
    model.controller = controller


def step_all(optimizer=None) -> None:
    """Update every controlled model once (with ``optimizer``: the models it trains): what the
    optimizer-step hook runs. Call it yourself after each step of a training loop that does not
    use ``torch.optim``."""
    for controller in list(_controllers):
        if optimizer is None or controller.trains(optimizer):
            controller.step()


def _install_hook() -> None:
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: step_all(optimizer))
