"""The paper's recipe as options: ``target_density`` (the coefficient steered to a density) and
``relu_gate`` (SiLU/GELU gates trained as ReLU), and the telemetry a run watches.

The conversion's oracle is eager autograd of the *ReLU-gated* model with the L1 term: with
``relu_gate=True`` twell trains exactly that model.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import twell_compile
from twell_compile import SkipReason
from twell_compile import density_control

from tests.ffn_models import ResidualStack, assert_grads_close, eager_loss, reset_state

D, H, L1 = 16, 40, 0.25


@pytest.fixture(autouse=True)
def fresh():
    reset_state()
    yield
    reset_state()


# ---------------------------------------------------------------------------------------------
# target_density
# ---------------------------------------------------------------------------------------------


def _coefficients(model) -> list[float]:
    return [s.l1_coeff for s in twell_compile.stats(model).layers]


def _train(model, run, opt, steps, x):
    for _ in range(steps):
        run(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("route", ["compile", "patch"])
def test_the_coefficient_climbs_while_the_density_is_above_target(route, monkeypatch):
    """A random ReLU FFN is ~50% dense: far above 0.5%, so with no ramp every layer's coefficient
    grows by the controller's largest step, once per optimizer step of this model."""
    monkeypatch.setattr(density_control, "RAMP_STEPS", 0)
    torch.manual_seed(0)
    model = ResidualStack(D, H, n=2)
    options = {"l1_coeff": 1e-4, "target_density": 0.005}
    if route == "compile":
        run = torch.compile(model, backend="twell", options={"inner": "aot_eager", **options})
    else:
        twell_compile.patch(model, **options)
        run = model
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)  # another model's optimizer: no update
    x = torch.randn(8, D)
    _train(model, run, opt, 5, x)
    other.step()
    want = 1e-4 * math.exp(density_control.MAX_STEP) ** 5
    assert _coefficients(model) == pytest.approx([want, want], rel=1e-4)
    stats = twell_compile.stats(model)
    assert all(s.target_density == 0.005 for s in stats.layers)
    assert "target 0.50%" in str(stats)


def test_the_coefficient_falls_below_target_and_stays_within_its_bounds(monkeypatch):
    """A layer made almost inactive (a large negative gate bias) is below any target: its
    coefficient falls; and no coefficient passes l1_coeff_max."""
    monkeypatch.setattr(density_control, "RAMP_STEPS", 0)
    torch.manual_seed(0)
    model = ResidualStack(D, H, n=2)
    with torch.no_grad():
        model.layers[0].gate.bias.fill_(-50.0)
    twell_compile.patch(model, l1_coeff=1e-3, target_density=0.2, l1_coeff_max=1.05e-3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _train(model, model, opt, 10, torch.randn(8, D))
    low, high = _coefficients(model)
    assert low == pytest.approx(1e-3 * math.exp(-density_control.MAX_STEP) ** 10, rel=1e-4)
    assert high == pytest.approx(1.05e-3, rel=1e-6)  # ~50% dense, above 20%: climbs, and stops at the ceiling


def test_steered_coefficients_reach_the_gradient():
    """After the controller moved the coefficients, the next step's gradients are those of the
    L1 term with the new, per-layer coefficients (a mean over the layers)."""
    torch.manual_seed(0)
    model = ResidualStack(D, H, n=2)
    ref = copy.deepcopy(model)
    twell_compile.patch(model, l1_coeff=1e-2, target_density=0.005)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(6, D)
    _train(model, model, opt, 3, x)
    coeffs = _coefficients(model)
    model(x).square().mean().backward()
    hiddens = [layer.hidden(h) for layer, h in zip(ref.layers, _inputs(ref, x))]
    l1 = sum(c * h.abs().sum() / h.shape[0] for c, h in zip(coeffs, hiddens)) / len(hiddens)
    (ref(x).square().mean() + l1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


def _inputs(model, x):
    """The input of each residual layer of ``ResidualStack``."""
    inputs = []
    for layer in model.layers:
        inputs.append(x)
        x = x + layer(x)
    return inputs


def test_the_controller_keeps_its_state_for_layers_on_several_devices():
    """Layers on two devices (pipeline parallel; ``meta`` stands in for the second): the smoothed
    density is kept between steps, not rebuilt, so a new reading moves it by SMOOTHING only."""
    from twell_compile import layers
    from twell_compile.lowering import telemetry

    owner = nn.Linear(1, 1)
    a = layers.register(owner, "a", "a", "cpu", hidden=8, l1_coeff=1e-4)
    b = layers.register(owner, "b", "b", "meta", hidden=8, l1_coeff=1e-4)
    controller = density_control.DensityController(0.005, 1.0)
    controller.attach(layers.model_of(owner))

    def call(active):
        telemetry.record(a.id, 4, torch.tensor(active), torch.tensor(0), None, True)
        telemetry.record(b.id, 4, torch.tensor(active, device="meta"), torch.tensor(0, device="meta"), None, True)

    call(16)  # density 16 / (4 · 8) = 0.5
    controller.step()
    state = dict(controller._state)
    call(8)  # 0.25
    controller.step()
    assert all(controller._state[k][3] is state[k][3] for k in ("cpu", "meta"))
    assert float(controller._state["cpu"][3][0]) == pytest.approx(0.5 + density_control.SMOOTHING * (0.25 - 0.5))


def test_the_setpoint_ramps_from_the_first_density_to_the_target(monkeypatch):
    """From a dense start the controller does not chase the target at once: each layer's setpoint
    falls from its first measured density to the target along a cubic ramp of RAMP_STEPS steps, and
    the coefficient moves by the (clipped) log-ratio of the density to that setpoint."""
    from twell_compile import layers
    from twell_compile.lowering import telemetry

    monkeypatch.setattr(density_control, "RAMP_STEPS", 10)
    owner = nn.Linear(1, 1)
    layer = layers.register(owner, "a", "a", "cpu", hidden=8, l1_coeff=1e-4)
    controller = density_control.DensityController(0.005, 1.0)
    controller.attach(layers.model_of(owner))
    want, moves = 1e-4, []
    for step in range(14):
        telemetry.record(layer.id, 4, torch.tensor(16), torch.tensor(0), None, True)  # density 0.5, held
        controller.step()
        setpoint = 0.005 + (0.5 - 0.005) * max(0.0, 1 - step / 10) ** 3
        move = min(max(density_control.GAIN * math.log(0.5 / setpoint), -density_control.MAX_STEP),
                   density_control.MAX_STEP)
        want *= math.exp(move)
        moves.append(move)
        assert float(layer.coefficients["cpu"]) == pytest.approx(want, rel=1e-5)
    assert moves[0] == 0.0 and 0 < moves[1] < density_control.MAX_STEP and moves[-1] == density_control.MAX_STEP


def test_a_recompile_with_another_l1_coeff_is_steered_from_its_new_value(monkeypatch):
    """A second compile with another ``l1_coeff`` gives the layers new coefficient tensors, which
    the new graphs read: the controller steers those, not the ones it held before."""
    monkeypatch.setattr(density_control, "RAMP_STEPS", 0)
    torch.manual_seed(0)
    model = ResidualStack(D, H, n=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(8, D)
    options = {"inner": "aot_eager", "target_density": 0.005, "l1_coeff_max": 1.0}
    _train(model, torch.compile(model, backend="twell", options={**options, "l1_coeff": 1e-4}), opt, 3, x)
    torch._dynamo.reset()
    _train(model, torch.compile(model, backend="twell", options={**options, "l1_coeff": 2e-4}), opt, 5, x)
    want = 2e-4 * math.exp(density_control.MAX_STEP) ** 5
    assert _coefficients(model) == pytest.approx([want, want], rel=1e-4)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 2])
def test_target_density_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match="target_density"):
        twell_compile.TwellOptions(target_density=bad)


def test_target_density_from_the_environment():
    opts = twell_compile.TwellOptions.from_env({"TWELL_TARGET_DENSITY": "0.005", "TWELL_L1_MAX": "1e-3"})
    assert opts.target_density == 0.005 and opts.l1_coeff_max == 1e-3
    with pytest.raises(ValueError, match="TWELL_TARGET_DENSITY"):
        twell_compile.TwellOptions.from_env({"TWELL_TARGET_DENSITY": "5"})


def test_the_default_keeps_a_fixed_coefficient():
    torch.manual_seed(0)
    model = ResidualStack(D, H, n=2)
    twell_compile.patch(model, l1_coeff=1e-3)
    _train(model, model, torch.optim.SGD(model.parameters(), lr=0.0), 4, torch.randn(8, D))
    assert _coefficients(model) == pytest.approx([1e-3, 1e-3])
    assert all(s.target_density is None for s in twell_compile.stats(model).layers)


# ---------------------------------------------------------------------------------------------
# relu_gate
# ---------------------------------------------------------------------------------------------


class GatedAct(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(H, D)
        self.act = act

    def hidden(self, x):
        return self.act(self.gate(x)) * self.up(x)

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


ACTIVATIONS = {"SiLU": nn.SiLU(), "GELU": nn.GELU(), "GELU tanh": nn.GELU(approximate="tanh")}


@pytest.mark.parametrize("route", ["compile", "patch"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_relu_gate_trains_the_relu_gated_model(act, route):
    torch.manual_seed(0)
    model = nn.Sequential(GatedAct(copy.deepcopy(ACTIVATIONS[act])), GatedAct(copy.deepcopy(ACTIVATIONS[act])))
    relu_model = copy.deepcopy(model)
    for m in relu_model:
        m.act = nn.ReLU()
    x = torch.randn(5, D)
    if route == "compile":
        run = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": L1, "relu_gate": True})
    else:
        twell_compile.patch(model, l1_coeff=L1, relu_gate=True)
        run = model
    run(x).square().mean().backward()
    eager_loss(relu_model, lambda: relu_model(x), lambda o: o.square().mean(), L1, modules=list(relu_model)).backward()
    assert_grads_close(model, relu_model, rtol=1e-4, atol_frac=1e-5)
    converted = twell_compile.report().rewritten
    assert len(converted) == 2 and all("gate as ReLU" in r.op for r in converted), str(twell_compile.report())
    assert act.split()[0] in converted[0].op


@pytest.mark.parametrize("route", ["compile", "patch"])
def test_without_relu_gate_a_silu_ffn_is_left_alone_and_reported(route):
    torch.manual_seed(0)
    model = nn.Sequential(GatedAct(nn.SiLU()))
    ref = copy.deepcopy(model)
    x = torch.randn(5, D)
    with pytest.warns(RuntimeWarning, match="relu_gate=True"):
        if route == "compile":
            out = torch.compile(model, backend="twell", options={"inner": "aot_eager"})(x)
        else:
            twell_compile.patch(model)
            out = model(x)
    torch.testing.assert_close(out, ref(x))
    report = twell_compile.report()
    assert not report.rewritten
    assert [s.reason for s in report.skipped] == [SkipReason.NOT_RELU]
    assert "relu_gate=True" in str(report) and "TWELL_RELU_GATE=1" in str(report)


def test_silu_elsewhere_is_not_ffn_like():
    """A SiLU that is not an FFN's gate (here: on the block's output) is neither rewritten nor reported."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D, D)

        def forward(self, x):
            return F.silu(self.proj(x)) + x

    torch.compile(Block(), backend="twell", options={"inner": "aot_eager"})(torch.randn(3, D))
    report = twell_compile.report()
    assert not report.rewritten and not report.skipped


# ---------------------------------------------------------------------------------------------
# Telemetry
# ---------------------------------------------------------------------------------------------


def test_dead_neurons_are_counted_over_a_window_of_tokens(monkeypatch):
    """Neurons that never fire in the window are dead. The gate is its bias alone, so every token
    fires the same 10 neurons of each 128-column tile (no tile overflows): 236 of 256 are dead."""
    from twell_compile.lowering import telemetry

    monkeypatch.setattr(telemetry, "DEAD_WINDOW_TOKENS", 64)
    model = nn.Sequential(GatedAct(nn.ReLU()))
    hidden = 256
    model[0].gate, model[0].up, model[0].down = nn.Linear(D, hidden), nn.Linear(D, hidden), nn.Linear(hidden, D)
    with torch.no_grad():
        model[0].gate.weight.zero_()
        model[0].gate.bias.fill_(-1.0)
        model[0].gate.bias[0:10] = 1.0
        model[0].gate.bias[128:138] = 1.0
    twell_compile.patch(model, l1_coeff=L1)
    x = torch.randn(40, D)
    model(x).sum().backward()
    assert twell_compile.stats().layers[0].dead_neurons is None  # 40 tokens sampled: the window is not full yet
    model(x).sum().backward()
    model(x).sum().backward()
    assert twell_compile.stats().layers[0].dead_neurons == pytest.approx(236 / 256)


def test_the_trainer_callback_logs_telemetry_and_sets_the_accumulation_scale():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from twell_compile.integrations import TwellCallback, telemetry_logs

    torch.manual_seed(0)
    model = ResidualStack(D, H, n=2)
    twell_compile.patch(model, l1_coeff=L1)
    model(torch.randn(4, D)).sum().backward()
    callback = TwellCallback()
    args = TrainingArguments(output_dir="unused", gradient_accumulation_steps=4, report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback.on_step_begin(args, state, control)
    assert twell_compile.get_loss_scale() == 0.25
    logs = {"loss": 1.0}
    state.log_history.append(dict(logs))
    callback.on_log(args, state, control, logs=logs, model=model)
    for key in ("twell/density", "twell/l0", "twell/l1", "twell/l1_coeff", "twell/dense_rows", "twell/sparse_layers"):
        assert key in logs and key in state.log_history[-1], logs
    assert logs["twell/l1_coeff"] == pytest.approx(L1)
    assert set(telemetry_logs(model, layer_paths=True)) == {k for k in logs if k.startswith("twell/")}
    assert logs["twell/sparse/layers.0"] == float(twell_compile.stats(model).layers[0].path == "sparse")
    callback.on_train_end(args, state, control)
    assert twell_compile.get_loss_scale() == 1.0


def test_the_trainer_callback_reaches_every_logger(monkeypatch, tmp_path):
    """Passed as ``callbacks=[TwellCallback()]``, which the Trainer puts after its reporting
    integrations, the callback still adds its keys before any logger reads them. Each layer's
    second 128-column tile never fires (zero gate rows stay zero: no gradient reaches them), so
    half of the neurons are dead once the (shrunk) window is full."""
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.integrations import integration_utils

    from twell_compile.integrations import TwellCallback, telemetry_logs
    from twell_compile.lowering import telemetry

    received = []

    class FakeLogger(TrainerCallback):  # registered as TensorBoard or W&B are
        def on_log(self, args, state, control, logs=None, **kwargs):
            received.append(dict(logs or {}))

    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "fake-logger", FakeLogger)
    monkeypatch.setattr(telemetry, "DEAD_WINDOW_TOKENS", 32)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, hidden_act="relu")
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight[128:].zero_()
    twell_compile.patch(model, l1_coeff=1e-4, target_density=0.005)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 16))]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                             report_to=["fake-logger"], use_cpu=True, save_strategy="no", disable_tqdm=True)
    callback = TwellCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    steps = [logs for logs in received if "loss" in logs]
    assert len(steps) == 2
    for logs in steps:
        assert logs["twell/dead_neurons"] == pytest.approx(0.5)
        assert logs["twell/l1_coeff"] > 1e-4  # steered up from a ~50% dense start
        assert {"twell/density", "twell/l0", "twell/l1", "twell/dense_rows", "twell/sparse_layers",
                "twell/sparse/model.layers.0.mlp", "twell/sparse/model.layers.1.mlp"} <= set(logs)
    final = {k: v for k, v in received[-1].items() if k.startswith("twell/")}
    assert final == pytest.approx(telemetry_logs(model, layer_paths=True))
