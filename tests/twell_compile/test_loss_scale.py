"""The injected L1 gradient behaves as part of the loss (docs/usage.md, "Loss scaling").

The oracle is eager autograd of ``S · (loss + l1_coeff · L1)`` for whatever ``S`` the training
loop applies: a ``torch.amp.GradScaler``'s scale (unscaled again before the step), or ``1 / K``
per micro-batch of gradient accumulation. Every test would fail on code whose injected term
ignores ``S`` (the scaler case by a factor of its scale, 1024 here; the accumulation case by K),
and each of the others on code that misses the case it names: a scale that changes between steps,
a GradScaler subclass with its own ``scale()``, a scaled backward that raises, accelerate imported
after twell, the Hugging Face Trainer's accumulation.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import twell_compile

from tests.ffn_models import ResidualStack, assert_close, assert_grads_close, eager_loss, reset_state
from tests.trainers import lightning_fit, small_llama, whole_batch_grads

D, H, L1 = 16, 40, 0.25


@pytest.fixture(autouse=True)
def fresh():
    reset_state()
    yield
    twell_compile.set_loss_scale(1.0)
    reset_state()


def _model():
    torch.manual_seed(0)
    return ResidualStack(D, H, n=2, kinds=("gated", "plain"))


def _loss(out):
    return out.square().mean()


ROUTES = ("compile", "patch")


def _prepare(model, route):
    if route.startswith("patch"):
        twell_compile.patch(model, l1_coeff=L1)
        return torch.compile(model) if route == "patch, then torch.compile" else model
    inner = "inductor" if route == "compile (inductor)" else "aot_eager"
    return torch.compile(model, backend="twell", options={"inner": inner, "l1_coeff": L1})


def _assert_grads_equal(grads: dict, ref: torch.nn.Module) -> None:
    """``grads`` (by parameter name, from a run elsewhere) match ``ref``'s, atol relative to their scale."""
    for name, p in ref.named_parameters():
        atol = 1e-5 * (1.0 + float(p.grad.abs().max()))
        assert_close(grads[name], p.grad, rtol=1e-4, atol=atol, name=f"grad {name}")


@pytest.mark.parametrize("route", ROUTES)
def test_grad_scaler_gives_the_unscaled_gradients(route):
    model = _model()
    ref = copy.deepcopy(model)
    run = _prepare(model, route)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(3, 4, D)
    scaler.scale(_loss(run(x))).backward()
    scaler.unscale_(opt)
    eager_loss(ref, lambda: ref(x), _loss, L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


@pytest.mark.parametrize("route", ROUTES)
def test_a_scale_that_changes_between_steps_is_followed(route):
    """growth_interval=1 doubles the scale after every good step, an Inf gradient halves it and
    skips the step: each step's unscaled gradients are the truth at whatever the scale is then."""
    model = _model()
    ref = copy.deepcopy(model)
    run = _prepare(model, route)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scales = []
    for step in range(4):
        x = torch.randn(3, D)
        model.zero_grad()
        ref.zero_grad()
        scales.append(scaler.get_scale())
        scaler.scale(_loss(run(x))).backward()
        if step == 2:
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # an overflow: back off
        else:
            scaler.unscale_(opt)
            eager_loss(ref, lambda: ref(x), _loss, L1).backward()
            assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5, prefix=f"scale {scales[-1]}: ")
        scaler.step(opt)
        scaler.update()
    assert scales == [1024.0, 2048.0, 4096.0, 2048.0]


@pytest.mark.parametrize("kind", ["ShardedGradScaler", "defined after twell's first forward"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_grad_scaler_subclass_with_its_own_scale_is_followed(route, kind):
    model = _model()
    ref = copy.deepcopy(model)
    run = _prepare(model, route)
    x = torch.randn(3, D)
    run(x)  # compiles or patches: twell's wrappers are in place from here on
    if kind == "ShardedGradScaler":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device="cpu", init_scale=1024.0)
    else:

        class LateScaler(torch.amp.GradScaler):
            def scale(self, outputs):  # never calls GradScaler.scale, as FSDP's does not
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(outputs.device)
                return outputs * self._scale

        scaler = LateScaler("cpu", init_scale=1024.0)
    scaler.scale(_loss(run(x))).backward()
    for p in model.parameters():
        p.grad /= 1024.0  # by hand: ShardedGradScaler.unscale_ needs a process group
    eager_loss(ref, lambda: ref(x), _loss, L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


def _raise(grad):
    raise RuntimeError("a hook failed on purpose")


@pytest.mark.parametrize("then", ["the scaled tensor is released", "accumulation with loss_scale"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_scaled_backward_that_raises_leaves_no_scale_behind(route, then):
    """The failed backward never reaches its end; its scale must not reach the next backward,
    whether the scaled tensor is released or kept (then the next loss-scale change drops it)."""
    k = 2
    model = _model()
    ref = copy.deepcopy(model)
    run = _prepare(model, route)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    out = run(torch.randn(3, D))
    out.register_hook(_raise)
    scaled = scaler.scale(_loss(out))
    with pytest.raises(RuntimeError, match="on purpose"):
        scaled.backward()
    model.zero_grad()
    batch = torch.randn(k * 3, D)
    if then == "the scaled tensor is released":
        del scaled, out
        _loss(run(batch)).backward()
    else:
        for micro in batch.chunk(k):
            with twell_compile.loss_scale(1 / k):
                (_loss(run(micro)) / k).backward()
    eager_loss(ref, lambda: ref(batch), _loss, L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


@pytest.mark.parametrize("route", ROUTES)
def test_a_backward_outside_the_scaler_is_not_scaled(route):
    """The scale applies to the backward of the tensor GradScaler.scale returned, and only to it."""
    model = _model()
    ref = copy.deepcopy(model)
    run = _prepare(model, route)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(3, D)
    scaler.scale(_loss(run(x))).backward()
    model.zero_grad()
    _loss(run(x)).backward()  # a plain backward afterwards: S = 1 again
    eager_loss(ref, lambda: ref(x), _loss, L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


@pytest.mark.parametrize("how", ["context manager", "set_loss_scale"])
@pytest.mark.parametrize("route", ROUTES)
def test_accumulated_micro_batches_equal_one_step_on_the_whole_batch(route, how):
    k = 3
    model = _model()
    ref = copy.deepcopy(model)
    run = _prepare(model, route)
    batch = torch.randn(k * 4, D)
    if how == "set_loss_scale":
        twell_compile.set_loss_scale(1 / k)
    for micro in batch.chunk(k):
        if how == "context manager":
            with twell_compile.loss_scale(1 / k):
                (_loss(run(micro)) / k).backward()
        else:
            (_loss(run(micro)) / k).backward()
    # the oracle: one step on the whole batch, L1 the mean over its tokens
    eager_loss(ref, lambda: ref(batch), _loss, L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


def test_accelerate_accumulation_and_its_scaler_are_followed():
    import accelerate
    k = 2
    model = _model()
    ref = copy.deepcopy(model)
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=k, cpu=True)
    twell_compile.patch(model, l1_coeff=L1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = accelerator.prepare(model, opt)
    batch = torch.randn(k * 3, D)
    for micro in batch.chunk(k):
        with accelerator.accumulate(model):
            accelerator.backward(_loss(model(micro)))
    eager_loss(ref, lambda: ref(batch), _loss, L1).backward()
    assert_grads_close(accelerator.unwrap_model(model), ref, rtol=1e-4, atol_frac=1e-5)


# A fresh interpreter, where twell installs its wrappers (patch, or compile on the first call)
# before accelerate is imported; the first micro-batch, of a new size, recompiles inside the call
# ``accelerator.backward(run(micro))``, which has already looked ``backward`` up. The model is
# ResidualStack's twin: tests/ is not importable there (the repository root stays off sys.path).
# argv: route, input path (state dict and batch), output path (the gradients).
_ACCELERATE_LATE = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import twell_compile

    class Gated(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)

        def forward(self, x):
            return self.down(torch.relu(self.gate(x)) * self.up(x))

    class Plain(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class Stack(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.layers = nn.ModuleList([Gated(d, h), Plain(d, h)])

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

    route, in_path, out_path = sys.argv[1:]
    data = torch.load(in_path)
    model = Stack(data["d"], data["h"])
    model.load_state_dict(data["state"])
    if route == "patch":
        twell_compile.patch(model, l1_coeff=data["l1"])
        run = model
    else:
        run = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": data["l1"]})
    run(torch.randn(2, data["d"]))
    assert "accelerate" not in sys.modules
    import accelerate

    k = data["k"]
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=k, cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    run, opt = accelerator.prepare(run, opt)
    model.zero_grad()
    for micro in data["batch"].chunk(k):
        with accelerator.accumulate(run):
            accelerator.backward(run(micro).square().mean())
    torch.save({n: p.grad for n, p in model.named_parameters()}, out_path)
    """
)


@pytest.mark.parametrize("route", ROUTES)
def test_accelerate_imported_after_twell_is_followed(route, tmp_path):
    k = 2
    model = _model()
    batch = torch.randn(k * 3, D)
    inputs, outputs = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"state": model.state_dict(), "batch": batch, "d": D, "h": H, "l1": L1, "k": k}, inputs)
    env = {key: v for key, v in os.environ.items() if not key.startswith("TWELL")}
    proc = subprocess.run([sys.executable, "-c", _ACCELERATE_LATE, route, str(inputs), str(outputs)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    eager_loss(model, lambda: model(batch), _loss, L1).backward()
    _assert_grads_equal(torch.load(outputs), model)


def test_lightning_accumulated_steps_equal_one_step_on_the_whole_batch(tmp_path):
    """accumulate_grad_batches=2 with ``TwellLightningCallback``: Lightning divides each
    micro-batch's loss by 2, and the gradients the optimizer gets are those of ``loss + l1_coeff ·
    L1`` on the whole batch; every log step reports twell's telemetry."""
    from twell_compile.integrations import TwellLightningCallback

    model, ref, ids = small_llama()
    twell_compile.patch(model, l1_coeff=L1)
    trainer, grads = lightning_fit(model, ids, tmp_path, callbacks=[TwellLightningCallback()], log_every=1)
    whole_batch_grads(ref, ids, L1)
    _assert_grads_equal(grads, ref)
    metrics = trainer.callback_metrics
    assert float(metrics["twell/sparse_layers"]) == 0.0  # the CPU path reports no sparse layer
    assert 0.0 < float(metrics["twell/density"]) < 1.0 and float(metrics["twell/l1_coeff"]) == pytest.approx(L1)
    assert "twell/sparse/model.layers.1.mlp" in metrics, list(metrics)
    assert twell_compile.get_loss_scale() == 1.0, "the run's end restores the loss scale"


def test_hf_trainer_accumulated_steps_equal_one_step_on_the_whole_batch(tmp_path):
    """gradient_accumulation_steps=2 with ``TwellCallback``: the gradients the optimizer gets are
    those of ``loss + l1_coeff · L1`` on the whole batch (a Llama with ``hidden_act="relu"``)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from twell_compile.integrations import TwellCallback

    model, ref, ids = small_llama()
    twell_compile.patch(model, l1_coeff=L1)
    grads = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=0.0, max_grad_norm=0.0,
                             report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                      callbacks=[Grab(), TwellCallback()])
    trainer.train()
    whole_batch_grads(ref, ids, L1)
    assert len(twell_compile.report().rewritten) == 2
    _assert_grads_equal(grads, ref)


# Inductor's partitioner recomputes cheap ops in the backward: the coefficient's snapshot must
# still be the value the forward saw, compiled by Inductor too.
@pytest.mark.parametrize("route", [*ROUTES, "compile (inductor)", "patch, then torch.compile"])
def test_set_l1_coeff_between_forward_and_backward_applies_to_the_next_forward(route):
    model = _model()
    ref = copy.deepcopy(model)
    run = _prepare(model, route)
    x = torch.randn(3, D)
    out = run(x)
    twell_compile.set_l1_coeff(4 * L1)  # must not break the backward in flight, nor change it
    _loss(out).backward()
    eager_loss(ref, lambda: ref(x), _loss, L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5, prefix="in flight: ")
    model.zero_grad()
    ref.zero_grad()
    _loss(run(x)).backward()
    eager_loss(ref, lambda: ref(x), _loss, 4 * L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5, prefix="next forward: ")


@pytest.mark.parametrize("value", [1e39, float("inf"), -1.0, float("nan")])
def test_a_refused_coefficient_changes_nothing(value):
    model = _model()
    ref = copy.deepcopy(model)
    run = _prepare(model, "compile")
    with pytest.raises(ValueError, match="set_l1_coeff"):
        twell_compile.set_l1_coeff(value)
    late = _model()  # built after the refusal: must start from its option, not from the refused value
    late_ref = copy.deepcopy(late)
    late_run = _prepare(late, "patch")
    x = torch.randn(3, D)
    _loss(run(x)).backward()
    _loss(late_run(x)).backward()
    eager_loss(ref, lambda: ref(x), _loss, L1).backward()
    eager_loss(late_ref, lambda: late_ref(x), _loss, L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)
    assert_grads_close(late, late_ref, rtol=1e-4, atol_frac=1e-5)


def test_an_l1_coeff_that_is_inf_in_float32_is_refused():
    with pytest.raises(ValueError, match="float32"):
        twell_compile.TwellOptions(l1_coeff=1e39)


@pytest.mark.parametrize("value", [0.0, -2.0, float("nan"), True])
def test_a_bad_loss_scale_is_refused(value):
    with pytest.raises(ValueError, match="loss scale"):
        twell_compile.set_loss_scale(value)
    assert twell_compile.get_loss_scale() == 1.0
