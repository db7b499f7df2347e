"""CUDA graphs and the per-layer dispatch (GPU only, ``-m gpu``).

* A layer captured after eager calls that measured its density and tuned its kernels records the
  sparse path from ``SPARSE_MIN_TOKENS_CAPTURED`` tokens, and the replay is bitwise the eager
  sparse op (inference, and a training forward + backward); a training replay reports its L1.
* A dense training step captured whole (forward and backward in one graph) keeps its forward's
  activations for its backward, as eagerly, and replays bitwise the eager step.
* A layer whose kernels never ran outside a capture records the dense path (tuning cannot run
  inside a capture), and its replay is the dense FFN.
* ``torch.compile(..., backend="twell", mode="reduce-overhead")`` captures and replays the ops,
  in inference and in training, with the results of the eager model; a layer that is sparse when
  its graph is warmed up records the sparse path.
"""

from __future__ import annotations

import pytest
import torch

from twell_compile.bench import make_problem
from twell_compile.lowering import cuda_ffn, force_path, telemetry
from twell_compile.lowering.dispatch_policy import (
    SPARSE_MIN_TOKENS,
    SPARSE_MIN_TOKENS_CAPTURED,
    is_warm,
    layer_policy,
    problem_signature,
)

from tests.ffn_models import GatedFFN, assert_close, eager_loss, reset_state

pytestmark = pytest.mark.gpu

TOKENS = SPARSE_MIN_TOKENS_CAPTURED
assert TOKENS < SPARSE_MIN_TOKENS  # outside capture, TOKENS alone would not go sparse


def _capture(fn):
    """``fn`` captured in a CUDA graph (after PyTorch's recommended side-stream warm-up is done by
    the caller), replayed once; returns the outputs the graph writes."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


def _eager_calls(fn, n):
    for _ in range(n):
        fn()
        torch.cuda.synchronize()  # the policy reads the previous call's counters once copied


def _sparse_reference(fn):
    with force_path("sparse"):
        return fn()


def test_graph_records_the_sparse_path_once_the_layer_is_measured_and_tuned():
    layer = 9_301
    x, wg, wu, wd = make_problem(TOKENS, 2048, 5632, 0.004, skewed=False)
    run = lambda: torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, layer)  # noqa: E731
    with torch.no_grad():
        _eager_calls(run, 3)  # dense (density unknown), then sparse once to tune, then as the policy says
        out = _capture(run)
        want = _sparse_reference(run)
    snap = telemetry.snapshot()[layer]
    assert snap["sparse"] == 1.0 and snap["tokens"] == TOKENS
    assert torch.equal(out, want)


def test_graph_records_a_sparse_training_step_bitwise_the_eager_one():
    layer = 9_302
    x, wg, wu, wd = make_problem(TOKENS, 2048, 5632, 0.004, skewed=False)
    params = [t.detach().requires_grad_() for t in (x, wg, wu, wd)]
    dout = torch.randn_like(x)
    coeff = torch.tensor(2e-5, device="cuda")

    def step():
        out = torch.ops.twell.ffn_train(*params, None, None, None, coeff, torch.ones_like(coeff), layer)[0]
        return (out, *torch.autograd.grad(out, params, dout))

    _eager_calls(step, 3)
    telemetry.record_l1(layer, torch.tensor(float("nan"), device="cuda"))
    got = _capture(step)  # the 4th call: eagerly it would not measure L1, a graph always does
    snap = telemetry.snapshot()[layer]
    x64, wg64, wu64 = (t.double() for t in (x, wg, wu))
    expected_l1 = (torch.relu(x64 @ wg64.T) * (x64 @ wu64.T)).abs().sum().item() / TOKENS
    assert snap["l1"] == pytest.approx(expected_l1, rel=2e-3), "each replay reports the layer's L1"
    want = _sparse_reference(step)
    assert telemetry.snapshot()[layer]["sparse"] == 1.0
    for g, w, name in zip(got, want, ("out", "dx", "dwg", "dwu", "dwd")):
        assert torch.equal(g, w), name


def test_graph_of_a_dense_training_step_hands_its_activations_to_the_backward(monkeypatch):
    layer = 9_304
    x, wg, wu, wd = make_problem(TOKENS, 2048, 5632, 0.2, skewed=False)
    params = [t.detach().requires_grad_() for t in (x, wg, wu, wd)]
    dout = torch.randn_like(x)
    coeff = torch.tensor(2e-5, device="cuda")
    taken = []
    take = cuda_ffn.take_saved  # the dense backward's (the sparse one's is sparse_path's)
    monkeypatch.setattr(cuda_ffn, "take_saved", lambda key, *, dense: taken.append(take(key, dense=dense)) or taken[-1])

    def step():
        out = torch.ops.twell.ffn_train(*params, None, None, None, coeff, torch.ones_like(coeff), layer)[0]
        return (out, *torch.autograd.grad(out, params, dout))

    with force_path("dense"):
        _eager_calls(step, 2)
        want = [t.detach().clone() for t in step()]  # detached: an eager autograd graph kept alive breaks the capture
        taken.clear()
        got = _capture(step)
    assert len(taken) == 1 and taken[0] is not None, "the captured backward used the forward's activations"
    for g, w, name in zip(got, want, ("out", "dx", "dwg", "dwu", "dwd")):
        assert torch.equal(g, w), name


def test_graph_records_the_dense_path_for_kernels_never_tuned_outside_it():
    layer = 9_303
    # a problem size no other test runs sparse, measured on calls too small to go sparse eagerly
    x, wg, wu, wd = make_problem(TOKENS, 1536, 4224, 0.004, skewed=False)
    small = x[: TOKENS // 2]
    signature = problem_signature(x, wg, wu, None, None, None, False)
    with torch.no_grad():
        _eager_calls(lambda: torch.ops.twell.ffn(small, wg, wu, wd, None, None, None, layer), 2)
        assert not is_warm(signature)
        assert layer_policy(layer, x.device).choose(training=False)  # its density is sparse
        out = _capture(lambda: torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, layer))
    assert telemetry.snapshot()[layer]["sparse"] == 0.0
    want = torch.nn.functional.linear(torch.relu(x @ wg.T) * (x @ wu.T), wd)
    assert_close(out, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()), name="dense path in a graph")


def _ffn_model():
    torch.manual_seed(0)
    return GatedFFN(256, 1024).to("cuda", torch.bfloat16)


def test_reduce_overhead_inference_replays_the_eager_result():
    reset_state()
    model = _ffn_model()
    compiled = torch.compile(model, backend="twell", mode="reduce-overhead")
    x = torch.randn(8, TOKENS // 8, 256, device="cuda", dtype=torch.bfloat16)
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    with torch.no_grad():
        want = model(x)
        for _ in range(4):  # warm-up, recording, replays
            got = compiled(x).clone()
            assert_close(got, want, rtol=2e-2, atol=2e-2, name="reduce-overhead inference")
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips, "graphs were skipped"
    reset_state()


def test_reduce_overhead_training_gives_the_eager_gradients():
    reset_state()
    model, ref = _ffn_model(), _ffn_model()
    compiled = torch.compile(model, backend="twell", mode="reduce-overhead")
    x = torch.randn(8, TOKENS // 8, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(8, TOKENS // 8, 256, device="cuda")
    loss_fn = lambda out: (out.float() * weight).sum()  # noqa: E731
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    eager_loss(ref, lambda: ref(x), loss_fn, 2e-5).backward()
    for step in range(4):  # warm-up, recording, replays
        model.zero_grad(set_to_none=True)
        loss_fn(compiled(x)).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            scale = float(q.grad.abs().max())
            assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2 * scale, name=f"step {step} grad {name}")
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips, "graphs were skipped"
    reset_state()


def _sparse_ffn_model(d: int, h: int):
    """A bias-free GatedFFN whose gate is active on ~0.4% of (token, neuron) pairs for ``x``, of a
    shape no other test runs (so its kernels are cold when the graph is warmed up)."""
    x, wg, wu, wd = make_problem(TOKENS, d, h, 0.004, skewed=False)
    model = GatedFFN(d, h, bias=False).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for lin, w in ((model.gate, wg), (model.up, wu), (model.down, wd)):
            lin.weight.copy_(w)
    return model, x


def _all_layers_sparse() -> bool:
    snap = telemetry.snapshot()
    return bool(snap) and all(v["sparse"] == 1.0 and v["tokens"] == TOKENS for v in snap.values())


def test_reduce_overhead_records_the_sparse_path_of_a_sparse_layer():
    model, x = _sparse_ffn_model(1024, 2816)
    with torch.no_grad():
        want = model(x)
    # First with cold kernels; then compiled again: new layers (density not yet measured) of a
    # problem whose kernels are tuned.
    for attempt in ("cold kernels", "new layers, tuned kernels"):
        reset_state()
        # The TwELL variant alone: what its capture records (the dense variant is variants.py's).
        compiled = torch.compile(model, backend="twell", options={"mode": "reduce-overhead", "dense_variant": False})
        skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        with torch.no_grad():
            for _ in range(4):  # warm-up (which measures the layer, tunes its kernels), recording, replays
                got = compiled(x).clone()
                assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()), name=attempt)
        assert _all_layers_sparse(), (attempt, telemetry.snapshot())
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips, "graphs were skipped"
    reset_state()


def test_reduce_overhead_training_records_the_sparse_path_of_a_sparse_layer():
    reset_state()
    model, x = _sparse_ffn_model(1024, 2816)
    ref, _ = _sparse_ffn_model(1024, 2816)
    compiled = torch.compile(model, backend="twell", options={"mode": "reduce-overhead", "dense_variant": False})
    weight = torch.randn(TOKENS, 1024, device="cuda")
    loss_fn = lambda out: (out.float() * weight).sum()  # noqa: E731
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    eager_loss(ref, lambda: ref(x), loss_fn, 2e-5).backward()
    for step in range(4):  # warm-up (which tunes the sparse kernels), recording, replays
        model.zero_grad(set_to_none=True)
        loss_fn(compiled(x)).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            scale = float(q.grad.abs().max())
            assert_close(p.grad, q.grad, rtol=3e-2, atol=3e-2 * scale, name=f"step {step} grad {name}")
    assert _all_layers_sparse(), telemetry.snapshot()
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips, "graphs were skipped"
    reset_state()
