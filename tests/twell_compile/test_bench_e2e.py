"""``twell bench --e2e`` (``twell_compile/bench_e2e.py``) on a tiny Llama, on CPU.

The benchmark itself runs on the H200; here its parts are checked for what they compute: the
gate-bias calibration must put every layer at the target density, and a whole run must time both
backends in both modes and read twell's counters.
"""

from __future__ import annotations

import pytest
import torch

from tests.ffn_models import reset_state

import transformers

from twell_compile import bench_e2e  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, vocab_size=128)


@pytest.fixture(autouse=True)
def _fresh():
    reset_state()
    yield
    reset_state()


def _gate_fractions(model, tokens):
    fractions = []
    hooks = [layer.mlp.gate_proj.register_forward_hook(lambda m, a, out: fractions.append((out > 0).float().mean().item()))
             for layer in model.model.layers]
    with torch.no_grad():
        model.model(tokens)
    for h in hooks:
        h.remove()
    return fractions


@pytest.mark.parametrize("density", [0.02, 0.2])
def test_calibration_puts_every_layer_at_the_target_density(density):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(bench_e2e.llama_config(num_hidden_layers=3, **TINY)).eval()
    tokens = torch.randint(0, 128, (2, 64))
    before = _gate_fractions(model, tokens)
    assert min(before) > 0.3  # a random ReLU model is ~50% dense
    achieved = bench_e2e.calibrate_gate_biases(model, tokens, density)
    after = _gate_fractions(model, tokens)
    assert len(achieved) == 3
    for a, b in zip(achieved, after):
        assert abs(a - density) < 0.01 and abs(b - density) < 0.01


def test_calibration_rejects_densities_outside_zero_one():
    model = transformers.LlamaForCausalLM(bench_e2e.llama_config(num_hidden_layers=1, **TINY))
    with pytest.raises(ValueError, match="density"):
        bench_e2e.calibrate_gate_biases(model, torch.zeros(1, 4, dtype=torch.long), 1.5)


def test_run_times_both_backends_in_both_modes():
    lines, saved = [], []
    rows = bench_e2e.run([0.05], layers=2, batch=2, seq=16, warmup=1, iters=1, device="cpu", dtype=torch.float32,
                         config_overrides=TINY, baseline="aot_eager", log=lines.append, on_point=saved.append)
    assert [r.mode for r in rows] == ["inference", "training"]
    assert saved == [rows]  # handed over after the (only) density, before run returns
    for r in rows:
        assert r.layers == 2 and r.tokens == 32
        assert r.inductor_tok_s > 0 and r.twell_tok_s > 0
        assert r.speedup == pytest.approx(r.twell_tok_s / r.inductor_tok_s)
        assert 0.0 < r.measured_density < 0.3  # twell's own counters, near the calibrated 5%
        assert 0.0 <= r.dense_rows <= r.tokens
    # lr=0 (the default): the training steps keep the calibrated weights, so the same density
    inference, training = rows
    assert training.measured_density == pytest.approx(inference.measured_density, rel=0.05)
    assert any("calibrated gate biases" in line for line in lines)
    table = bench_e2e.format_table(rows, baseline="aot_eager")
    assert "training" in table and "aot_eager tok/s" in table and "dense rows" in table


def test_compile_mode_reaches_both_backends(monkeypatch):
    """``--compile-mode``: Inductor gets ``mode``; twell, which also needs ``options`` (torch.compile
    refuses both), gets ``options["mode"]``; the rows say which mode they timed."""
    seen = []

    def fake_compile(model, *, backend, **kwargs):
        seen.append((backend, kwargs))
        return model  # eager: this test is about the arguments

    monkeypatch.setattr(torch, "compile", fake_compile)
    rows = bench_e2e.run([0.05], layers=1, batch=1, seq=8, warmup=1, iters=1, device="cpu", dtype=torch.float32,
                         config_overrides=TINY, compile_mode="reduce-overhead", log=lambda line: None)
    assert [r.compile_mode for r in rows] == ["reduce-overhead"] * 2
    assert seen == [
        ("inductor", {"mode": "reduce-overhead"}),
        ("twell", {"options": {"mode": "reduce-overhead"}}),
        ("inductor", {"mode": "reduce-overhead"}),
        ("twell", {"options": {"l1_coeff": 2e-5, "mode": "reduce-overhead"}}),
    ]
    with pytest.raises(ValueError, match="compile_mode"):
        bench_e2e.run([0.05], layers=1, batch=1, seq=8, device="cpu", dtype=torch.float32, config_overrides=TINY,
                      compile_mode="fast", log=lambda line: None)


def test_tokens_per_s_is_the_median_step_and_logs_stalls(monkeypatch):
    # One timed step stalls (a first autotuning, say): the median ignores it and the log names it.
    clock = iter([0.0, 0.1, 1.0, 1.1, 2.0, 3.0, 4.0, 4.1])  # starts and ends of 4 timed steps
    monkeypatch.setattr(bench_e2e.time, "perf_counter", lambda: next(clock))
    calls, lines = [], []
    speed = bench_e2e.tokens_per_s(lambda: calls.append(1), tokens=1000, warmup=2, iters=4, log=lines.append,
                                    label="training twell")
    assert len(calls) == 6
    assert speed == pytest.approx(1000 / 0.1)
    assert len(lines) == 1 and "training twell: 1 of 4 timed steps" in lines[0] and "1000 ms" in lines[0], lines
