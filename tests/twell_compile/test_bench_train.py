"""``twell bench --train`` end to end on the CPU: a tiny model, a few steps, every output."""

from __future__ import annotations

import csv

import pytest

from twell_compile import bench, bench_train


TINY = ["--device", "cpu", "--hidden", "32", "--intermediate", "128", "--layers", "2", "--heads", "4", "--batch", "2",
        "--seq", "16", "--steps", "4", "--eval-every", "2", "--val-batches", "1", "--warmup-steps", "1",
        "--baseline-backend", "aot_eager", "--twell-inner", "aot_eager", "--no-progress"]


def test_bench_train_writes_a_row_per_variant_and_turn_and_a_plot(tmp_path, capsys):
    argv = ["--train", *TINY, "--variants", "inductor", "twell", "silu-relu-gate", "--target-density", "0.01",
            "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "train.csv").open()))
    assert [(r["step"], r["variant"]) for r in rows] == [
        ("2", "inductor"), ("2", "twell"), ("2", "silu-relu-gate"), ("4", "inductor"), ("4", "twell"), ("4", "silu-relu-gate")]
    for r in rows:
        assert float(r["train_loss"]) > 0 and float(r["val_loss"]) > 0 and float(r["step_ms"]) > 0
        assert 0 < float(r["density"]) <= 1 and len(r["density_per_layer"].split(";")) == 2
    twell = [r for r in rows if r["variant"] == "twell"]
    assert all(float(r["l1_coeff"]) > 0 and int(r["sparse_layers"]) >= 0 for r in twell)
    assert (tmp_path / "train.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "speed vs inductor" in out and "silu-relu-gate" in out


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
