"""The injected L1 gradient behaves as part of the loss (docs/usage.md, "Loss scaling").

The oracle is eager autograd of ``S · (loss + l1_coeff · L1)`` for whatever ``S`` the training
loop applies: a ``torch.amp.GradScaler``'s scale (unscaled again before the step), or ``1 / K``
per micro-batch of gradient accumulation. Every test would fail on code whose injected term
ignores ``S`` (the scaler case by a factor of its scale, 1024 here; the accumulation case by K).
"""

from __future__ import annotations

import copy

import pytest
import torch

import twell_compile

from tests.ffn_models import ResidualStack, assert_grads_close, eager_loss, reset_state

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
    if route == "patch":
        twell_compile.patch(model, l1_coeff=L1)
        return model
    return torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": L1})


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


@pytest.mark.parametrize("route", ROUTES)
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
