"""The graph variants on the GPU: the dense variant is Inductor's code with the L1 term, and a
model switches between it and the TwELL ops without losing exactness, also in CUDA graphs."""

from __future__ import annotations

import copy

import pytest
import torch

import twell_compile
from twell_compile import variants

from tests.ffn_models import ResidualStack, eager_loss, reset_state

pytestmark = pytest.mark.gpu

D, H, L1 = 256, 1024, 1e-3


def _model():
    torch.manual_seed(0)
    return ResidualStack(D, H, n=3).to("cuda", torch.bfloat16)


def _check(model, ref, name):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        scale = float(q.grad.abs().max())
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=3e-2, atol=3e-2 * scale, msg=f"{name} {n}")


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_switching_variants_keeps_every_step_exact(mode, monkeypatch):
    reset_state()
    model = _model()
    ref = copy.deepcopy(model)
    options = {"l1_coeff": L1} if mode == "default" else {"l1_coeff": L1, "mode": mode}
    run = torch.compile(model, backend="twell", options=options)
    prefer = {"sparse": False}
    monkeypatch.setattr(twell_compile.lowering, "prefers_sparse", lambda *a: prefer["sparse"])
    monkeypatch.setattr(variants, "MEASURE_STEPS", 2)
    monkeypatch.setattr(variants, "WARMUP_STEPS", 2)
    x = torch.randn(4, 1024, D, device="cuda", dtype=torch.bfloat16)
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    seen = set()
    for step in range(16):
        if step == 3:
            prefer["sparse"] = True
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        run(x).float().square().mean().backward()
        eager_loss(ref, lambda: ref(x), lambda o: o.float().square().mean(), L1).backward()
        _check(model, ref, f"step {step}")
        seen.add(variants.coordinators()[0].current)
    assert seen == {"dense", "twell"}
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips, "graphs were skipped"
    reset_state()
