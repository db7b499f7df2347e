"""Calls replayed from CUDA graphs (``call_replay``; GPU only, ``-m gpu``).

* A replayed call is bitwise the eager call on both paths, for new tokens on every call,
  non-finite rows included, and its telemetry record is the eager call's.
* An output still held is never overwritten: the next call records a second graph, and past
  ``GRAPHS_PER_KEY`` held outputs the call runs eagerly.
* Weights changed in place (an optimizer step) are seen: the layer records anew and drops its
  graphs of the old weights.
* Sparse training steps replayed (forward and backward) are bitwise the eager steps, across
  weight updates, with one or two forwards held before a backward, and with weights cast anew at
  every step (autocast's copies, which move in memory), which still replay: the layer's graphs
  copy the weights in.
* Calls above ``REPLAY_MAX_WORK`` tokens × D × H and calls inside a capture are never replayed; the
  graphs per layer stay bounded.
"""

from __future__ import annotations

import pytest
import torch

from twell_compile.bench import make_problem
from twell_compile.lowering import call_replay, force_path, telemetry

pytestmark = pytest.mark.gpu

M, D, H = 1024, 512, 1536


@pytest.fixture(autouse=True)
def _fresh_graphs():
    call_replay.clear()
    yield
    call_replay.clear()


def _problem(seed=0, density=0.01, m=M):
    return make_problem(m, D, H, density, skewed=False, seed=seed)


def _keys(layer):
    return [(k, s) for k, s in call_replay.KEYS.items() if k[0] == layer]


def _call(x, wg, wu, wd, layer):
    return torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, layer)


def _eager(x, wg, wu, wd, layer, monkeypatch, path="sparse"):
    """The call with replays off, on ``path``."""
    with monkeypatch.context() as m, torch.no_grad(), force_path(path):
        m.setattr(call_replay, "ENABLED", False)
        return _call(x, wg, wu, wd, layer).clone()


@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_replayed_calls_are_bitwise_the_eager_calls(path, monkeypatch):
    layer = 9_401 if path == "sparse" else 9_402
    _, wg, wu, wd = _problem()
    outs = []
    with torch.no_grad(), force_path(path):
        for seed in range(5):
            x = _problem(seed=seed)[0]
            if seed == 3:
                x[7, 5] = float("inf")  # a non-finite row: the guard's dense row, replayed too
                x[9, 1] = float("nan")
            out = _call(x, wg, wu, wd, layer)
            record = telemetry.buffer(layer, x.device).clone()
            want = _eager(x, wg, wu, wd, layer + 50, monkeypatch, path)
            want_record = telemetry.buffer(layer + 50, x.device).clone()
            assert torch.equal(out, want) or torch.equal(out.isnan(), want.isnan()) and torch.equal(
                out.nan_to_num(), want.nan_to_num()), f"call {seed}"
            assert torch.equal(record[1:5], want_record[1:5]), f"call {seed}: tokens, active, dense rows, path"
            outs.append(out.data_ptr())
            del out
    (key, state), = _keys(layer)
    assert key[2] == (path == "sparse")
    assert len(state.graphs) == 1, "one graph: each output was dropped before the next call"
    assert outs[1:] == [state.graphs[0].result.data_ptr()] * 4, "the first call is eager, every later one replayed"
    assert telemetry.buffer(layer, wg.device)[0].item() == 5, "every call counted"


def test_an_output_still_held_is_never_overwritten(monkeypatch):
    layer = 9_403
    _, wg, wu, wd = _problem()
    xs = [_problem(seed=s)[0] for s in range(5)]
    with torch.no_grad(), force_path("sparse"):
        _call(xs[0], wg, wu, wd, layer)  # eager
        held = [_call(x, wg, wu, wd, layer) for x in xs[1:]]  # recorded, recorded, then eager twice
        copies = [h.clone() for h in held]
        again = _call(xs[1], wg, wu, wd, layer)
    (_, state), = _keys(layer)
    assert len(state.graphs) == call_replay.GRAPHS_PER_KEY
    assert len({h.data_ptr() for h in held}) == 4
    for x, h, c in zip(xs[1:], held, copies):
        assert torch.equal(h, c), "a held output was overwritten"
        assert torch.equal(h, _eager(x, wg, wu, wd, layer + 50, monkeypatch))
    assert torch.equal(again, held[0])
    del held, copies, h, c
    with torch.no_grad(), force_path("sparse"):
        out = _call(xs[2], wg, wu, wd, layer)
    assert out.data_ptr() in {g.result.data_ptr() for g in state.graphs}, "a graph whose output was dropped replays"


def test_weights_changed_in_place_are_seen(monkeypatch):
    layer = 9_404
    x, wg, wu, wd = _problem()
    with torch.no_grad(), force_path("sparse"):
        for _ in range(3):
            _call(x, wg, wu, wd, layer)
        wu.mul_(2.0)
        wg.add_(0.01)
        out = [_call(x, wg, wu, wd, layer) for _ in range(3)][-1]  # eager, recorded, recorded (the first held)
    assert torch.equal(out, _eager(x, wg, wu, wd, layer + 50, monkeypatch))
    (key, state), = _keys(layer)
    assert key[-1][0][1][0] == wu._version and len(state.graphs) == 2, "the old weights' graphs are dropped"


def test_large_and_captured_calls_are_not_replayed(monkeypatch):
    x, wg, wu, wd = _problem()
    monkeypatch.setattr(call_replay, "REPLAY_MAX_WORK", 2 * M * D * H)
    with torch.no_grad(), force_path("sparse"):
        big = _problem(m=2 * M + 8)[0]
        for _ in range(3):
            _call(big, wg, wu, wd, 9_405)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _call(x, wg, wu, wd, 9_406)  # warm
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _call(x, wg, wu, wd, 9_406)
    assert not _keys(9_405)
    assert all(not s.graphs for _, s in _keys(9_406)), "a call inside a capture belongs to that capture"


def _training_steps(monkeypatch, layer, *, replay, steps=5, forwards=1, cast=False):
    """``steps`` training steps of one layer (``forwards`` calls summed before each backward, then
    an SGD update): each step's outputs, input gradients, weight gradients and the telemetry.
    ``cast``: float32 weights cast to bf16 anew at every step, as autocast does, with the last
    step's casts alive during each forward, so that the casts move in memory."""
    x0, wg0, wu0, wd0 = _problem()
    log = []
    with monkeypatch.context() as m:
        m.setattr(call_replay, "ENABLED", replay)
        params = [(t.float() if cast else t.clone()).requires_grad_() for t in (wg0, wu0, wd0)]
        coeff = torch.tensor(2e-4, device="cuda")
        held = None
        with force_path("sparse"):
            for step in range(steps):
                weights = [p.to(torch.bfloat16) for p in params] if cast else params
                xs = [_problem(seed=10 * step + i)[0].requires_grad_() for i in range(forwards)]
                outs = [torch.ops.twell.ffn_train(x, *weights, None, None, None, coeff, torch.ones_like(coeff),
                                                  layer)[0] for x in xs]
                held = weights  # the previous step's casts are freed only now
                gen = torch.Generator(device="cuda").manual_seed(step)
                douts = [torch.randn(o.shape, generator=gen, device="cuda", dtype=o.dtype) for o in outs]
                sum((o * d).sum() for o, d in zip(outs, douts)).backward()
                log.append([o.detach().clone() for o in outs] + [x.grad.clone() for x in xs]
                           + [p.grad.clone() for p in params] + [telemetry.buffer(layer, x0.device)[1:].clone()])
                with torch.no_grad():
                    for p in params:
                        p.sub_(0.05 * p.grad)
                        p.grad = None
                del outs, douts, xs
    del held
    return log


@pytest.mark.parametrize("forwards", [1, 2])
def test_replayed_training_steps_are_bitwise_the_eager_steps(monkeypatch, forwards):
    layer = 9_410 + forwards
    replayed = _training_steps(monkeypatch, layer, replay=True, forwards=forwards)
    eager = _training_steps(monkeypatch, layer + 50, replay=False, forwards=forwards)
    for step, (got, want) in enumerate(zip(replayed, eager)):
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b) or torch.equal(a.nan_to_num(), b.nan_to_num()), f"step {step}, tensor {i}"
    graphs = [g for k, s in _keys(layer) if k[3] and not k[4] for g in s.graphs]  # training, L1 not measured
    assert len(graphs) == forwards, "one graph per forward held at once"
    assert all(any(b.graphs for b in g.backward.values()) for g in graphs), "and their backwards"
    assert not _keys(layer + 50)


def test_weights_cast_anew_every_step_still_replay(monkeypatch):
    replayed = _training_steps(monkeypatch, 9_420, replay=True, steps=8, cast=True)
    outcomes = call_replay.stats().outcomes
    assert (9_420, 0) in call_replay.COPIED_WEIGHTS, outcomes
    eager = _training_steps(monkeypatch, 9_470, replay=False, steps=8, cast=True)
    for step, (got, want) in enumerate(zip(replayed, eager)):
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b) or torch.equal(a.nan_to_num(), b.nan_to_num()), f"step {step}, tensor {i}"
    assert outcomes.get("forward replayed", 0) > 0 and outcomes.get("backward replayed", 0) > 0, outcomes


def test_graphs_per_layer_stay_bounded():
    layer = 9_408
    _, wg, wu, wd = _problem()
    with torch.no_grad(), force_path("dense"):
        for m in range(64, 64 * 9, 64):
            x = _problem(m=m)[0]
            for _ in range(2):
                _call(x, wg, wu, wd, layer)
    assert sum(len(s.graphs) for _, s in _keys(layer)) <= call_replay.GRAPHS_PER_LAYER
    assert _keys(layer)[-1][1].graphs, "the most recent shape keeps its graph"
