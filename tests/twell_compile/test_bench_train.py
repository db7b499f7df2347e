"""``twell bench --train`` end to end on the CPU: a tiny model, a few steps, every output."""

from __future__ import annotations

import csv

import pytest

from twell_compile import bench, bench_train, density_control


TINY = ["--device", "cpu", "--hidden", "32", "--intermediate", "128", "--layers", "2", "--heads", "4", "--batch", "2",
        "--seq", "16", "--steps", "4", "--eval-every", "2", "--val-batches", "1", "--warmup-steps", "1",
        "--baseline-backend", "aot_eager", "--twell-inner", "aot_eager", "--no-progress"]


def test_bench_train_writes_a_row_per_variant_and_turn_and_a_plot(tmp_path, capsys, monkeypatch):
    from twell_compile.lowering import telemetry

    monkeypatch.setattr(telemetry, "DEAD_WINDOW_TOKENS", 32)  # a turn is 2 steps of 2 x 16 tokens
    monkeypatch.setattr(density_control, "RAMP_STEPS", 1)  # steer to the target itself from the first step
    variants = ["inductor", "twell", "twell-fixed", "silu-relu-gate", "silu"]
    argv = ["--train", *TINY, "--variants", *variants, "--target-density", "0.01", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "train.csv").open()))
    assert [(r["step"], r["variant"]) for r in rows] == [(step, v) for step in ("2", "4") for v in variants]
    for r in rows:
        assert float(r["train_loss"]) > 0 and float(r["val_loss"]) > 0 and float(r["step_ms"]) > 0
        assert 0 < float(r["density"]) <= 1 and len(r["density_per_layer"].split(";")) == 2
        assert r["peak_gib"] == r["reserved_gib"] == "nan"  # CPU: no CUDA memory to report
    twell = [r for r in rows if r["variant"] in ("twell", "twell-fixed", "silu-relu-gate")]
    for r in twell:
        assert float(r["l1_coeff"]) > 0 and 0 <= float(r["dead_neurons"]) <= 1
        assert len(r["paths"]) == 2 and set(r["paths"]) <= {"S", "D"} and r["paths"].count("S") == int(r["sparse_layers"])
    baselines = [r for r in rows if r["variant"] in ("inductor", "silu")]
    assert all(r["paths"] == "-" and r["l1_coeff"] == "nan" for r in baselines)
    fixed = [float(r["l1_coeff"]) for r in rows if r["variant"] == "twell-fixed"]
    assert fixed == pytest.approx([2e-5, 2e-5])  # the default coefficient, not steered
    steered = [float(r["l1_coeff"]) for r in rows if r["variant"] == "twell"]
    assert steered[1] > steered[0] > 2e-5  # ~50% dense against a 1% target: the coefficient climbs
    assert (tmp_path / "train.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "speed vs inductor" in out and "silu-relu-gate" in out
    assert "replayed calls: 0 CUDA graphs recorded in this run, 0 kept at its end, holding 0 MB" in out  # CPU: none
    turn = out[out.index("step 4:"):].splitlines()[1:len(variants) + 1]  # the last turn's lines, one per variant
    for r in rows[-len(variants):]:
        (line,) = [l for l in turn if l.split()[0] == r["variant"]]
        assert ("(paths " in line) == (r["paths"] != "-") and (r["paths"] == "-" or f"(paths {r['paths']})" in line)


def test_each_step_trains_the_next_token_as_a_user_does():
    """A step passes ``labels=input_ids`` of ``--seq`` tokens, which the model shifts itself; labels
    shifted by the caller too would train the token after next."""
    import torch

    cfg = bench_train.TrainConfig(device="cpu", batch=2, seq=16, val_batches=1)
    batches = bench_train.Batches(bench_train.stdlib_bytes(limit=1 << 20), cfg.batch, cfg.seq, "cpu", 0, 1)
    calls = []
    weight = torch.nn.Parameter(torch.zeros(()))

    def model(**inputs):
        calls.append(inputs)
        return type("Out", (), {"loss": weight * 0 + 1.0})

    opt = torch.optim.SGD([weight], lr=0.0)
    variant = bench_train.Variant("inductor", torch.nn.Linear(1, 1), model, opt,
                                  torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), False)
    bench_train.train_turn(variant, batches, 0, 2, cfg)
    assert len(calls) == 2
    for inputs in calls:
        assert inputs["labels"] is inputs["input_ids"] and tuple(inputs["input_ids"].shape) == (2, 16)
    assert all(tuple(t.shape) == (2, 16) for t in batches.val_set)


def test_bench_train_refuses_an_unknown_variant():
    with pytest.raises(SystemExit):
        bench_train.main([*TINY, "--variants", "nope"])


def test_the_text_is_the_standard_library():
    data = bench_train.stdlib_bytes(limit=1 << 20)
    assert data.numel() >= 1 << 16 and b"def " in bytes(data[: 1 << 16].tolist())


def test_bench_distributed_compares_losses_of_two_runs(tmp_path):
    """The N-GPU bench (NCCL, so not run here) ends with ``compare``: per-step losses of two runs of
    the same global batch agree within bf16's spread, per backend."""
    import json

    from twell_compile import bench_distributed

    one = {"twell": {"losses": [4.0, 3.9]}, "inductor": {"losses": [4.0, 3.95]}}
    near = {"twell": {"losses": [4.01, 3.91]}, "inductor": {"losses": [4.0, 3.96]}}
    far = {"twell": {"losses": [4.0, 3.5]}, "inductor": {"losses": [4.0, 3.95]}}
    paths = {}
    for name, data in (("one", one), ("near", near), ("far", far)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(data))
    assert bench_distributed.main(["compare", str(paths["one"]), str(paths["near"])]) == 0
    assert bench_distributed.main(["compare", str(paths["one"]), str(paths["far"])]) == 1


def test_the_replay_line_says_why_calls_ran_eagerly():
    outcomes = {"forward replayed": 90, "forward eager: first call of its key": 4,
                "forward eager: its graphs' results still held": 6, "backward replayed": 88,
                "layers whose training graphs copy the weights in": 3, "forward recorded": 5, "training forwards from graphs": 88}
    assert bench_train.outcome_parts(outcomes) == [
        "forward calls: 90 replayed, 10 eager (its graphs' results still held 6, first call of its key 4)",
        "backward calls: 88 replayed, 0 eager",
        "layers whose training graphs copy the weights in 3",
        "training forwards from graphs 88",
    ]
    assert bench_train.outcome_parts({}) == []


def test_a_turn_line_gives_the_memory_when_it_was_measured():
    row = dict(step=50, variant="twell", train_loss=1.0, val_loss=1.1, density=0.005, density_per_layer="0.005",
               sparse_layers=1, paths="S", layers=1, l1_coeff=1e-3, dead_neurons=0.0, graph_variant="twell",
               step_ms=30.0, ratio=1.1)
    assert "GiB" not in bench_train.format_turn([bench_train.TrainRow(**row)])
    line = bench_train.format_turn([bench_train.TrainRow(**row, peak_gib=12.34, reserved_gib=20.0)])
    assert line.endswith("30.0 ms/step (1.10x), 12.3 GiB peak, 20.0 reserved"), line
