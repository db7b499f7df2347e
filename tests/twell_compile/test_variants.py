"""The dense variant and the switch between variants (``variants.py``), on the CPU.

On a GPU the backend compiles each graph twice: the model's own FFN code with the L1 term and
twell's counters (the dense variant), and the TwELL ops. Here the dense variant is built on the
CPU too (``backend.VARIANTS_ON_CPU``), and the layers' preference for the sparse path, which on
a GPU comes from their measured density, is set by the test. Whatever variant runs, every step's
gradients are the eager oracle's.
"""

from __future__ import annotations

import copy

import pytest
import torch

import twell_compile
from twell_compile import backend, variants

from tests.ffn_models import ResidualStack, assert_grads_close, eager_loss, reset_state

D, H, L1 = 16, 40, 0.25


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    reset_state()
    monkeypatch.setattr(backend, "VARIANTS_ON_CPU", True)
    monkeypatch.setattr(variants, "WARMUP_STEPS", 1)
    monkeypatch.setattr(variants, "MEASURE_STEPS", 2)
    monkeypatch.setattr(variants, "REMEASURE_STEPS", 4)
    yield
    reset_state()


def _model():
    torch.manual_seed(0)
    return ResidualStack(D, H, n=3, kinds=("gated", "plain"))


def _step(model, run, ref, x):
    model.zero_grad()
    ref.zero_grad()
    run(x).square().mean().backward()
    eager_loss(ref, lambda: ref(x), lambda o: o.square().mean(), L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_the_dense_variant_is_exact_and_writes_the_counters(inner):
    model = _model()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="twell", options={"inner": inner, "l1_coeff": L1})
    x = torch.randn(2, 5, D)
    _step(model, run, ref, x)
    (coordinator,) = variants.coordinators()
    assert coordinator.current == "dense"
    stats = twell_compile.stats()
    assert [s.where for s in stats.layers] == ["layers.0", "layers.1", "layers.2"]
    assert all(s.path == "dense" and s.calls == 1 and s.tokens == 10 for s in stats.layers)
    hiddens = []
    handles = [m.register_forward_hook(lambda mod, a, out: hiddens.append(mod.hidden(a[0]))) for m in ref.layers]
    with torch.no_grad():
        ref(x)
    for h in handles:
        h.remove()
    for s, h in zip(stats.layers, hiddens):
        assert s.l1 == pytest.approx(float(h.abs().sum() / 10), rel=1e-5)
        assert s.l0 == pytest.approx(float((h != 0).sum() / 10))


def test_a_sparse_model_is_measured_and_every_step_stays_exact(monkeypatch):
    model = _model()
    ref = copy.deepcopy(model)
    run = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": L1})
    prefer = {"sparse": False}
    monkeypatch.setattr(twell_compile.lowering, "prefers_sparse", lambda *a: prefer["sparse"])
    x = torch.randn(4, D)
    _step(model, run, ref, x)
    (coordinator,) = variants.coordinators()
    seen = set()
    for step in range(12):
        if step == 2:
            prefer["sparse"] = True  # the layers became sparse: a measurement of both variants starts
        _step(model, run, ref, x)
        seen.add(coordinator.current)
    assert seen == {"dense", "twell"}
    assert set(coordinator.periods) == {"dense", "twell"} and all(p > 0 for p in coordinator.periods.values())
    prefer["sparse"] = False
    coordinator.current, coordinator.next_check = "twell", 0  # on TwELL, and the layers densify again
    _step(model, run, ref, x)
    _step(model, run, ref, x)
    assert coordinator.current == "dense"


def test_per_layer_graphs_switch_together():
    model = _model()
    for layer in model.layers:
        layer.compile(backend="twell", options={"inner": "aot_eager", "l1_coeff": L1})
    model(torch.randn(3, D)).sum().backward()
    (coordinator,) = variants.coordinators()
    assert sorted(coordinator.layers) == sorted(s.layer for s in twell_compile.stats().layers)


def test_dense_variant_false_compiles_the_ops_only():
    model = _model()
    torch.compile(model, backend="twell", options={"inner": "aot_eager", "dense_variant": False})(torch.randn(3, D))
    assert variants.coordinators() == []
    assert [r.op for r in twell_compile.report().rewritten] == ["twell::ffn_train"] * 3


def test_a_recompiled_graph_takes_over_the_step_count():
    """A graph replaced by a recompile is no longer called; the model's steps are then counted
    by the graph that is."""
    from twell_compile.variants import GraphVariants, ModelVariants

    coordinator = ModelVariants(torch.device("cpu"), True, False)
    first = GraphVariants(lambda: "first", lambda: "first", {1: 8}, coordinator)
    second = GraphVariants(lambda: "second", lambda: "second", {1: 8}, coordinator)
    first()
    assert coordinator.steps == 1
    for _ in range(10):
        second()
    assert coordinator.steps >= 5 and coordinator.clock() is second


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_the_dense_variant_samples_which_neurons_fired(inner, monkeypatch):
    """Dead neurons on the dense variant, from the same state the TwELL ops update. Layer 0's gate
    is its bias for neurons 0-9 (they fire on every token), neurons 10-19 fire on token 3 alone
    (feature 0 is 1 there, 0 elsewhere), and the other 236 never fire. The variant reads one token
    in 8 a call at a turning offset, so token 3 is read every 8th call and neurons 10-19 stay alive."""
    from twell_compile.lowering import telemetry

    monkeypatch.setattr(telemetry, "DEAD_WINDOW_TOKENS", 64)
    monkeypatch.setattr(twell_compile.lowering, "prefers_sparse", lambda *a: False)
    torch.manual_seed(0)
    model = ResidualStack(D, 256, n=2)
    with torch.no_grad():
        gate = model.layers[0].gate
        gate.weight.zero_()
        gate.bias.fill_(-1.0)
        gate.bias[0:10] = 1.0
        gate.weight[10:20, 0] = 10.0
    run = torch.compile(model, backend="twell", options={"inner": inner, "l1_coeff": L1})
    x = torch.randn(16, D)
    x[:, 0] = 0.0
    x[3, 0] = 1.0
    for _ in range(33):  # 2 tokens sampled a call: 66 > 64 once 33 calls ran
        run(x).square().mean().backward()
    (coordinator,) = variants.coordinators()
    assert coordinator.current == "dense"
    first, second = twell_compile.stats(model).layers
    assert first.dead_neurons == pytest.approx(236 / 256)
    assert second.dead_neurons is not None and second.dead_neurons < 0.5
    last, seen = telemetry.fired_state(first.layer, "cpu", 256)
    assert float(seen) == 66 and float(last[12]) == 56  # token 3 last read by the 28th call (offset 27 mod 8)


def test_steps_that_compile_or_tune_kernels_are_measured_again(monkeypatch):
    """The TwELL variant's first sparse steps tune its kernels: a measurement over them would time
    the tuning and keep the dense variant for hundreds of steps. Measured steps in which
    ``first_launches`` moved are measured again (at most MEASURE_RETRIES times)."""
    import time

    from twell_compile.variants import GraphVariants, ModelVariants

    launches = {"n": 0, "tuning_calls": 5}
    monkeypatch.setattr(twell_compile.lowering, "first_launches", lambda: launches["n"])
    monkeypatch.setattr(twell_compile.lowering, "prefers_sparse", lambda *a: True)

    def twell_step():
        if launches["tuning_calls"] > 0:  # the first calls tune: slow, and counted
            launches["tuning_calls"] -= 1
            launches["n"] += 1
            time.sleep(0.05)
        return "twell"

    def dense_step():
        time.sleep(0.005)
        return "dense"

    coordinator = ModelVariants(torch.device("cpu"), True, False)
    graph = GraphVariants(dense_step, twell_step, {1: 8}, coordinator)
    ran = [graph() for _ in range(40)]
    assert coordinator.trial is None and set(coordinator.periods) == {"dense", "twell"}
    assert coordinator.periods["twell"] < 1.0 < coordinator.periods["dense"]  # ms: the tuning steps are not in it
    assert coordinator.current == "twell" and ran[-1] == "twell"

    # Kernels that never stop compiling: the measurement still ends, after MEASURE_RETRIES retries.
    variants.reset()
    launches.update(n=0, tuning_calls=10 ** 6)
    coordinator = ModelVariants(torch.device("cpu"), True, False)
    graph = GraphVariants(dense_step, twell_step, {1: 8}, coordinator)
    # one call starts the trial, then the warm-up and 1 + MEASURE_RETRIES windows of measured steps
    for _ in range(1 + variants.WARMUP_STEPS + variants.MEASURE_STEPS * (1 + variants.MEASURE_RETRIES) + 1):
        graph()
    assert coordinator.trial is not None and list(coordinator.trial["periods"]) == ["twell"]
    assert coordinator.trial["retries"] == 0 and coordinator.current == "dense"  # now measuring the dense variant


def test_work_between_two_measured_steps_is_left_out_and_a_variants_own_cost_kept(monkeypatch):
    """An evaluation between two steps of a measurement (one period ~50x a step) must not decide
    the variant; a recurring cost of the variant itself (one step in 8 ~1.3x) stays in its period."""
    from twell_compile.variants import GraphVariants, ModelVariants

    monkeypatch.setattr(variants, "WARMUP_STEPS", 2)
    monkeypatch.setattr(variants, "MEASURE_STEPS", 8)
    monkeypatch.setattr(twell_compile.lowering, "prefers_sparse", lambda *a: True)
    clock = {"now": 0.0, "twell_calls": 0}
    monkeypatch.setattr(variants.time, "perf_counter", lambda: clock["now"])

    def twell_step():  # 8 ms a step, every 8th 10.4 ms (its L1 measurement), one evaluation after the 6th
        clock["twell_calls"] += 1
        clock["now"] += 0.0104 if clock["twell_calls"] % 8 == 0 else 0.008
        if clock["twell_calls"] == 6:
            clock["now"] += 0.4
        return "twell"

    def dense_step():
        clock["now"] += 0.010
        return "dense"

    coordinator = ModelVariants(torch.device("cpu"), True, False)
    graph = GraphVariants(dense_step, twell_step, {1: 8}, coordinator)
    for _ in range(2 * (1 + variants.WARMUP_STEPS + variants.MEASURE_STEPS) + 1):
        graph()
    assert coordinator.trial is None and coordinator.current == "twell"
    assert coordinator.periods["dense"] == pytest.approx(10.0)
    assert coordinator.periods["twell"] == pytest.approx((6 * 8.0 + 10.4) / 7)  # the evaluation's period left out
    assert variants.step_period([1.0, 1.0, 1.0, 1.3]) == pytest.approx(1.075)
    assert variants.step_period([1.0, 1.0, 5.0, 1.0]) == pytest.approx(1.0)
