"""``patch()`` and the option checks on the inputs that used to go wrong quietly.

Each test would fail on the code before these fixes: the FFN whose down projection is declared
first was silently not patched; a model patched in eval mode kept its eval branches in training;
``torch.func`` and bad options gave errors that named neither twell nor the knob.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import twell_compile

from tests.ffn_models import assert_close, assert_grads_close, eager_loss, reset_state, unwrap

D, H, L1 = 16, 40, 0.25


@pytest.fixture(autouse=True)
def fresh():
    reset_state()
    yield
    reset_state()


class DownFirst(nn.Module):
    """The down projection declared before gate and up (its in_features are H, not D)."""

    def __init__(self):
        super().__init__()
        self.down = nn.Linear(H, D)
        self.gate = nn.Linear(D, H)
        self.up = nn.Linear(D, H)

    def hidden(self, x):
        return F.relu(self.gate(x)) * self.up(x)

    def forward(self, x):
        return self.down(self.hidden(x))


class Branchy(nn.Module):
    """An FFN whose forward differs in training: scaled input in eval, the FFN itself in training."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def hidden(self, x):
        return F.relu(self.up(x))

    def forward(self, x):
        if not self.training:
            x = x * 0.5
        return self.down(F.relu(self.up(x)))


def test_patch_finds_an_ffn_whose_down_projection_is_declared_first():
    torch.manual_seed(0)
    model = nn.Sequential(DownFirst())
    ref = copy.deepcopy(model)
    result = twell_compile.patch(model, l1_coeff=L1)
    assert [r.where for r in result.rewritten] == ["0"], str(result)
    x = torch.randn(5, D)
    model(x).square().mean().backward()
    eager_loss(ref, lambda: ref(x), lambda o: o.square().mean(), L1, modules=[ref[0]]).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


def test_patch_in_eval_mode_follows_the_training_flag_at_call_time():
    torch.manual_seed(0)
    model = nn.Sequential(Branchy()).eval()
    ref = copy.deepcopy(model)
    result = twell_compile.patch(model, l1_coeff=L1)
    x = torch.randn(4, D)
    with torch.no_grad():  # eval: the scaled-input branch (not an FFN as a whole): the module's own forward
        with pytest.warns(RuntimeWarning, match="eval mode its forward is not one FFN"):
            assert_close(model(x), ref(x), rtol=1e-6, atol=1e-6, name="eval")
    model.train()
    ref.train()
    assert_close(model(x).detach(), ref(x).detach(), rtol=1e-5, atol=1e-6, name="train")
    model.zero_grad()
    model(x).square().mean().backward()
    ref.zero_grad()
    eager_loss(ref, lambda: ref(x), lambda o: o.square().mean(), L1, modules=[ref[0]]).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)
    assert [r.where for r in result.rewritten] == ["0"] and not result.skipped


def test_patch_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match=r"patch\(model\) needs a torch.nn.Module, got NoneType"):
        twell_compile.patch(None)


@pytest.mark.parametrize("options", [[("l1_coeff", 1e-3)], "l1_coeff=1e-3", 2e-5])
def test_options_that_are_not_a_dict_are_refused_by_name(options):
    with pytest.raises(Exception) as info:
        torch.compile(nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)), backend="twell",
                      options=options)(torch.randn(2, D))
    err = unwrap(info.value)
    assert isinstance(err, ValueError) and "options must be a dict" in str(err)


def test_torch_func_over_a_patched_model_says_twell_cannot_do_it():
    from torch.func import functional_call, grad

    model = nn.Sequential(DownFirst())
    twell_compile.patch(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(RuntimeError, match="twell: torch.func transforms"):
        grad(lambda p: functional_call(model, p, (torch.randn(3, D),)).sum())(params)


def test_mixed_dtypes_outside_autocast_fail_as_eager_does():
    """bf16 weights and a float32 input: eager F.linear raises; so do both routes, never upcasting."""
    model = nn.Sequential(DownFirst()).to(torch.bfloat16)
    x = torch.randn(3, D)
    with pytest.raises(RuntimeError):
        model(x)
    compiled = torch.compile(copy.deepcopy(model), backend="twell", options={"inner": "aot_eager"})
    with pytest.raises(Exception):
        compiled(x)
    assert not twell_compile.report().rewritten
    assert any(s.reason.name == "MIXED_DTYPES" for s in twell_compile.report().skipped)
    patched = copy.deepcopy(model)
    twell_compile.patch(patched)
    with pytest.raises((RuntimeError, ValueError), match="dtype"):
        patched(x)


# ---------------------------------------------------------------------------------------------
# Hooks on a projection: the op would bypass them, so the module runs its own forward
# ---------------------------------------------------------------------------------------------


def _hook_down(model, kind, seen):
    """A hook that sees each call of ``model[0].down``; returns what removes it."""
    down = model[0].down
    if kind == "forward hook":
        handle = down.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
        return handle.remove
    if kind == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: seen.append(out.shape) if mod is down else None)
        return handle.remove
    from accelerate import cpu_offload  # weights on meta, loaded by hooks that replace each forward
    from accelerate.hooks import remove_hook_from_submodules

    cpu_offload(model, execution_device=torch.device("cpu"))
    return lambda: remove_hook_from_submodules(model)


@pytest.mark.parametrize("kind", ["forward hook", "global hook", "accelerate cpu_offload"])
def test_a_hooked_projection_runs_the_modules_own_forward_and_says_so(kind):
    torch.manual_seed(0)
    model = nn.Sequential(DownFirst())
    ref = copy.deepcopy(model)
    twell_compile.patch(model, l1_coeff=L1)
    x = torch.randn(4, D)
    seen = []
    remove = _hook_down(model, kind, seen)
    try:
        with pytest.warns(RuntimeWarning, match=r"0 runs its own forward.*(hooks|replaced on the instance)"):
            out = model(x)
        assert_close(out, ref(x), rtol=1e-6, atol=1e-6, name=kind)
        if kind != "accelerate cpu_offload":
            assert len(seen) == 1  # the hook ran, once
        assert any(s.reason is twell_compile.SkipReason.PATCH_FALLBACK for s in twell_compile.report().skipped)
    finally:
        remove()
    if kind == "accelerate cpu_offload":
        return  # its weights stay offloaded
    # Hooks gone: the TwELL op again, L1 term included.
    model.zero_grad()
    model(x).square().mean().backward()
    eager_loss(ref, lambda: ref(x), lambda o: o.square().mean(), L1, modules=[ref[0]]).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


# ---------------------------------------------------------------------------------------------
# FFN-like modules patch() cannot replace are reported, never skipped in silence
# ---------------------------------------------------------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x, residual):
        return residual + self.down(F.relu(self.up(x)))


class ScaledInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def hidden(self, x):
        return F.relu(self.up(x * 2))

    def forward(self, x):
        return self.down(F.relu(self.up(x * 2)))


def test_patch_reports_the_ffn_like_modules_it_leaves_alone():
    torch.manual_seed(0)
    model = nn.ModuleDict({"two": TwoInputs(), "scaled": ScaledInput(),
                           "tanh": nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))})  # not FFN-like
    with pytest.warns(RuntimeWarning, match="no FFN of ModuleDict has been rewritten"):
        result = twell_compile.patch(model, l1_coeff=L1)
    assert not result.rewritten
    reasons = [(s.where, s.reason) for s in result.skipped]
    assert reasons == [("two", twell_compile.SkipReason.EXTRA_INPUTS), ("scaled", twell_compile.SkipReason.NOT_WHOLE_MODULE)]
    assert result.skipped[0].detail == "forward(x, residual)"
    assert [(s.where, s.reason) for s in twell_compile.report().skipped] == reasons
    # "torch.compile can": the compile route rewrites the one the patch left, L1 term included.
    scaled = model["scaled"]
    ref = copy.deepcopy(scaled)
    x = torch.randn(3, D)
    torch.compile(scaled, backend="twell", options={"inner": "aot_eager", "l1_coeff": L1})(x).square().mean().backward()
    eager_loss(ref, lambda: ref(x), lambda o: o.square().mean(), L1, modules=[ref]).backward()
    assert_grads_close(scaled, ref, rtol=1e-4, atol_frac=1e-5)
