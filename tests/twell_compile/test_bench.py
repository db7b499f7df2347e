"""``twell bench`` (``twell_compile/bench.py``): the parts that run without a GPU.

The timings need the H200; here the synthetic problem must have the density it is asked for
(uniform, skewed, and with heavy rows), and the table and CSV must carry every row's variant.
"""

from __future__ import annotations

import csv
import io
import math

import pytest
import torch
import torch.nn.functional as F

from twell_compile import bench, bench_timing

M, D, H = 2048, 256, 512


def _active(x, wg):
    return F.linear(x, wg) > 0


@pytest.mark.parametrize("density", [0.01, 0.05])
@pytest.mark.parametrize("skewed", [False, True])
def test_problem_has_the_target_density(density, skewed):
    x, wg, _, _ = bench.make_problem(M, D, H, density, skewed=skewed, dtype=torch.float32, device="cpu")
    measured = _active(x, wg).float().mean().item()
    assert measured == pytest.approx(density, rel=0.15)


def test_heavy_rows_are_active_on_almost_every_neuron():
    density, heavy = 0.01, 5
    x, wg, _, _ = bench.make_problem(M, D, H, density, skewed=False, heavy_rows=heavy, dtype=torch.float32, device="cpu")
    rows = torch.linspace(0, M - 1, heavy).round().long()
    active = _active(x, wg).float()
    assert active[rows].mean().item() == pytest.approx(1 - density, abs=0.02)
    others = torch.ones(M, dtype=torch.bool)
    others[rows] = False
    assert active[others].mean().item() == pytest.approx(density, rel=0.15)
    # Every heavy row overflows the TwELL tiles: far more actives per 128-column tile than slots.
    from twell_compile.kernels.format import DEFAULT_LAYOUT

    per_tile = active[rows].reshape(heavy, -1, DEFAULT_LAYOUT.tile_n).sum(-1)
    assert (per_tile > DEFAULT_LAYOUT.slots).all()


@pytest.mark.parametrize("tiles", [1, 3])
def test_overflow_rows_overflow_exactly_the_chosen_tiles(tiles):
    """``overflow_rows`` tokens are active on every neuron of ``overflow_tiles`` tiles, so those tiles
    overflow their slots, and sparse elsewhere; the other tokens keep the target density."""
    from twell_compile.kernels.format import DEFAULT_LAYOUT

    assert bench.TILE_N == DEFAULT_LAYOUT.tile_n
    density, n = 0.01, 7
    x, wg, _, _ = bench.make_problem(M, D, H, density, skewed=False, overflow_rows=n, overflow_tiles=tiles,
                                     dtype=torch.float32, device="cpu")
    rows = bench.overflow_row_ids(M, n)
    assert rows.unique().numel() == n and int(rows.max()) > M * 0.9  # late tokens too
    active = _active(x, wg).float()
    per_tile = active.reshape(M, -1, DEFAULT_LAYOUT.tile_n).sum(-1)
    over = per_tile > DEFAULT_LAYOUT.slots
    assert over[rows].sum(-1).tolist() == [tiles] * n
    assert (per_tile[rows][over[rows]] == DEFAULT_LAYOUT.tile_n).all()  # every neuron of those tiles
    others = torch.ones(M, dtype=torch.bool)
    others[rows] = False
    assert not over[others].any()
    assert active[others].mean().item() == pytest.approx(density, rel=0.15)
    assert active[rows][~over[rows].repeat_interleave(DEFAULT_LAYOUT.tile_n, 1)].mean().item() < 5 * density


def test_overflow_rows_are_checked():
    with pytest.raises(ValueError, match="overflow_rows"):
        bench.make_problem(8, D, H, 0.01, skewed=False, overflow_rows=9, device="cpu")
    with pytest.raises(ValueError, match="overflow_tiles"):
        bench.make_problem(8, D, H, 0.01, skewed=False, overflow_rows=1, overflow_tiles=5, device="cpu")  # H=512: 4 tiles


def test_heavy_rows_outside_the_batch_are_refused():
    with pytest.raises(ValueError, match="heavy_rows"):
        bench.make_problem(8, D, H, 0.01, skewed=False, heavy_rows=9, device="cpu")


def _row(**kw):
    values = dict(mode="training", m=M, d=D, h=H, variant="uniform", target_density=0.005, measured_density=0.0058,
                  active_per_token=3.0, dense_eager_ms=2.0, dense_compiled_ms=1.8, twell_ms=1.6, twell_sparse_ms=1.5,
                  speedup_vs_eager=1.25, speedup_vs_compiled=1.125, sparse_speedup_vs_eager=1.33, rel_err_twell=1e-3,
                  rel_err_dense=3e-3, peak_mem_dense_mb=100.0, peak_mem_twell_mb=50.0)
    values.update(kw)
    return bench.Row(**values)


def test_table_and_csv_name_the_heavy_and_overflow_rows(tmp_path):
    rows = [_row(), _row(heavy_rows=14), _row(overflow_rows=46, overflow_tiles=2)]
    out = io.StringIO()
    bench.print_table(rows, file=out)
    lines = out.getvalue().splitlines()
    assert "uniform+14hr" in lines[3] and "uniform+14hr" not in lines[2]
    assert "uniform+46ov2t" in lines[4]
    path = bench.write_csv(rows, tmp_path / "sub" / "bench.csv")
    read = list(csv.DictReader(path.open()))
    assert [r["heavy_rows"] for r in read] == ["0", "14", "0"]
    assert [(r["overflow_rows"], r["overflow_tiles"]) for r in read] == [("0", "0"), ("0", "0"), ("46", "2")]
    assert read[1]["variant"] == "uniform"


def test_graph_columns_appear_only_when_measured(tmp_path):
    out = io.StringIO()
    bench.print_table([_row()], file=out)
    assert "graphs" not in out.getvalue()
    out = io.StringIO()
    bench.print_table([_row(), _row(dense_graphed_ms=2.0, twell_graphed_ms=0.8, speedup_graphed=2.5)], file=out)
    lines = out.getvalue().splitlines()
    assert "graphs d/t ms" in lines[0] and "x graph" in lines[0]
    assert lines[3].endswith("2.000/0.800   2.50x") and lines[2].endswith("-       -")
    read = list(csv.DictReader(bench.write_csv([_row(dense_graphed_ms=2.0, twell_graphed_ms=0.8, speedup_graphed=2.5)],
                                               tmp_path / "bench.csv").open()))
    assert (read[0]["dense_graphed_ms"], read[0]["twell_graphed_ms"], read[0]["speedup_graphed"]) == ("2.0", "0.8", "2.5")


def test_floors_table_lists_only_the_points_that_measured_them(tmp_path):
    """``--floors``: the floor is the gate GEMM plus the gather, and the table compares the eager
    dense time and the forced sparse op with it."""
    out = io.StringIO()
    bench.print_floors([_row()], file=out)
    assert out.getvalue() == ""
    floored = _row(mode="inference", m=16384, dense_eager_ms=1.7, twell_sparse_ms=1.15, gate_gemm_ms=0.52, gather_floor_ms=0.33)
    assert floored.floor_ms == pytest.approx(0.85) and floored.floor_speedup == pytest.approx(2.0)
    bench.print_floors([_row(), floored], file=out)
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("floors (inference)") and "gate GEMM" in lines[2] and "sparse/floor" in lines[2]
    assert len(lines) == 5  # blank line, title, header, rule, the one row with floors
    assert lines[4].split() == ["16384", "uniform", "0.58%", "1.700", "1.600", "1.150", "0.520", "0.330", "0.850",
                                "2.00x", "1.35x"]
    read = list(csv.DictReader(bench.write_csv([_row(), floored], tmp_path / "bench.csv").open()))
    assert (read[0]["gate_gemm_ms"], read[1]["gate_gemm_ms"], read[1]["gather_floor_ms"]) == ("nan", "0.52", "0.33")


def test_plot_draws_the_floor_beside_the_measured_lines(tmp_path, monkeypatch):
    import matplotlib  # noqa: F401  (a test dependency: the plot must be drawn)
    from matplotlib.figure import Figure

    saved = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (saved.append(fig), real_savefig(fig, *a, **kw)))
    rows = [_row(mode="inference", measured_density=p, gate_gemm_ms=0.5, gather_floor_ms=0.1 + p * 60)
            for p in (0.003, 0.005, 0.01)] + [_row()]
    paths = bench.write_outputs(rows, tmp_path)
    assert paths[1].name == "speedup_vs_density.png" and paths[1].stat().st_size > 0
    ax = saved[0].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels.count("floor (gate GEMM + bare gather): inference, M=2048, uniform") == 1
    assert not any(label.startswith("floor") and "training" in label for label in labels)
    floor_line = next(line for line in ax.get_lines() if line.get_label().startswith("floor"))
    assert list(floor_line.get_ydata()) == pytest.approx([2.0 / (0.6 + p * 60) for p in (0.003, 0.005, 0.01)])


@pytest.mark.gpu
def test_floors_are_measured_on_the_gpu():
    """Inference points time both floors with the other providers; training points do not."""
    row = bench.bench_point(4096, 256, 512, 0.01, skewed=False, train=False, compiled_cache={}, reps=3,
                            max_sparse_train_density=0.02, floors=True)
    assert row.gate_gemm_ms > 0 and row.gather_floor_ms > 0
    assert row.floor_speedup == pytest.approx(row.dense_eager_ms / (row.gate_gemm_ms + row.gather_floor_ms))
    dense = bench.bench_point(4096, 256, 512, 0.2, skewed=False, train=False, compiled_cache={}, reps=1,
                              max_sparse_train_density=0.02, floors=True)
    assert math.isnan(dense.floor_ms)  # past FLOOR_MAX_DENSITY rows overflow: a pair gather is no floor


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True])
def test_graphed_columns_are_measured_on_the_gpu(train):
    """``--graphs``: both providers captured and timed (values are not asserted, only that the
    captures ran and the speedup is their ratio)."""
    row = bench.bench_point(4096, 256, 512, 0.01, skewed=False, train=train, compiled_cache={}, reps=3,
                            max_sparse_train_density=0.02, graphs=True)
    assert row.dense_graphed_ms > 0 and row.twell_graphed_ms > 0
    assert row.speedup_graphed == pytest.approx(row.dense_graphed_ms / row.twell_graphed_ms)


@pytest.mark.gpu
def test_host_line_measures_each_call_beside_its_target_on_the_gpu():
    """The three forced calls run on the GPU (the dense one through the op's dense path) and each
    reading stands beside its target: values are not asserted, only that all three were taken."""
    line = bench.host_line(256, 512)
    assert "not measured" not in line, line
    for (path, train), target in bench.HOST_TARGETS_MS.items():
        assert f"{bench.HOST_LABELS[path, train]} " in line and f"(target {target:g}: " in line, line

@pytest.mark.parametrize("argv,flag", [(["--heavy-rows", "0", "65"], "--heavy-rows"), (["--overflow-rows", "65"], "--overflow-rows"),
                                       (["--overflow-rows", "4", "--overflow-tiles", "45"], "--overflow-tiles")])
def test_cli_refuses_rows_or_tiles_the_problem_does_not_have(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        bench.main(["--m", "64", *argv])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_timed_training_steps_invalidate_the_ops_weight_caches():
    """Each timed training step ends with ``weights_updated``, as an optimizer step would for the
    weights' version counters, so the op's per-weight work (here its ``Wdᵀ`` copy) is redone and
    timed every step, as in real training; the values stay the same."""
    from twell_compile.lowering.weight_cache import WeightPrep

    wu = torch.randn(24, 8, requires_grad=True)
    wd = torch.randn(8, 24, requires_grad=True)
    before = wd.detach().clone()
    first = WeightPrep.get(None, wu, wd, None, None, None)[2]
    assert WeightPrep.get(None, wu, wd, None, None, None)[2] is first, "cached while unchanged"
    bench.weights_updated([wd])
    second = WeightPrep.get(None, wu, wd, None, None, None)[2]
    assert second is not first and torch.equal(second, first)
    assert torch.equal(wd.detach(), before)


def test_host_line_names_the_cpu_and_says_when_the_step_was_not_measured(monkeypatch):
    """The benchmark's host line: the CPU model and core count, and the host time of a sparse
    inference call, a sparse training step and a dense inference call, each beside its target, or
    why it was not measured (here: a failing probe), without losing the run."""
    import builtins

    real_open = builtins.open
    cpuinfo = "processor\t: 0\nvendor_id\t: X\nmodel name\t: Some CPU @ 2.00GHz\nflags\t: a b\n"
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(cpuinfo) if path == "/proc/cpuinfo"
                        else real_open(path, *a, **k))
    assert bench.cpu_model() == "Some CPU @ 2.00GHz"

    def fail(d, h, *, train, path, route="compiled"):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(bench, "host_ms", fail)
    line = bench.host_line(64, 128)
    assert line.startswith(f"host: {bench.cpu_model()}, ") and "cores" in line
    assert line.count("not measured (RuntimeError: no GPU here)") == 3
    times = {("sparse", False, "compiled"): 0.375, ("sparse", True, "compiled"): 0.5, ("sparse", True, "autograd"): 0.75,
             ("dense", False, "compiled"): 0.08}
    monkeypatch.setattr(bench, "host_ms", lambda d, h, *, train, path, route="compiled": times[path, train, route])
    assert bench.host_line(64, 128).endswith(
        "at M=512, D=64, H=128 (GPU kept busy; a training step of 4 chained layers, its ops called as a model "
        "compiled with backend='twell' calls them): a sparse inference call 0.375 ms (target 0.15: 2.5x over), "
        "a sparse training step per layer 0.500 ms (target 0.5: met; 0.750 ms through eager autograd), "
        "a dense inference call 0.080 ms (target 0.1: met)")


def test_host_line_says_which_reading_had_calls_run_eagerly_instead_of_replayed(monkeypatch):
    """After a training run that spent the replayed graphs' memory share, the forced calls run
    eagerly: each reading says how many of its calls did, rather than reporting eager host time as
    a replayed call's."""
    from twell_compile.lowering import call_replay

    monkeypatch.setattr(call_replay, "OUTCOMES", type(call_replay.OUTCOMES)({"forward replayed": 7}))

    def eager(d, h, *, train, path, route="compiled"):
        call_replay.OUTCOMES["forward eager: memory share spent"] += 20
        return 1.0

    monkeypatch.setattr(bench, "host_ms", eager)
    note = "1.000 ms [20 of its 20 forward calls ran eagerly: memory share spent 20]"
    assert bench.host_line(64, 128).endswith(
        f"a sparse inference call {note} (target 0.15: 6.7x over), a sparse training step per layer {note} "
        f"(target 0.5: 2.0x over; {note} through eager autograd), a dense inference call {note} (target 0.1: 10.0x over)")

    def replayed(d, h, *, train, path, route="compiled"):
        call_replay.OUTCOMES["forward replayed"] += 20
        call_replay.OUTCOMES["forward eager: first call of its key"] += 1  # a reading's warm-up
        # Only a training route lets some calls run eagerly: the note is that reading's alone.
        call_replay.OUTCOMES["forward eager: memory share spent"] += 5 if route == "autograd" else 0
        return 0.1

    monkeypatch.setattr(bench, "host_ms", replayed)
    line = bench.host_line(64, 128)
    assert line.count("ran eagerly") == 1, line
    assert "0.100 ms [5 of its 25 forward calls ran eagerly: memory share spent 5] through eager autograd" in line
    assert line.endswith("a dense inference call 0.100 ms (target 0.1: met)")


def test_tuned_txt_lists_the_autotuners_choices(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "tuned_configs", lambda: [("_wgrad_kernel", "D=2048 H=5632 torch.bfloat16", "BD: 1024")])
    path = bench.write_tuned(tmp_path / "out" / "tuned.txt")
    assert path.read_text() == "_wgrad_kernel  D=2048 H=5632 torch.bfloat16  ->  BD: 1024\n"
    monkeypatch.setattr(bench, "tuned_configs", lambda: [])
    assert "no kernel was autotuned" in bench.write_tuned(path).read_text()


def test_interleaved_timing_alternates_the_providers_order(monkeypatch):
    """``interleaved_ms`` samples every provider once per round, in the given order and then in
    reverse (so no provider always runs after the others on a GPU whose clock drops under load),
    waits for the GPU before each sample (so no provider spends a lead the host built during
    another's), flushes L2 before every call, and returns each provider's median over its calls
    (so a sample's slow first call, the host's head start, does not set it). CUDA events are faked
    on a clock that each call advances by its provider's cost."""
    clock = {"now": 0.0}
    calls: list[str] = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock["now"]

        def synchronize(self):
            calls.append("sync")

        def elapsed_time(self, end):
            assert calls[-1] == "sync", "an event read before the GPU was waited for"
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(bench_timing, "L2_FLUSH_BYTES", 64)
    real_empty = torch.empty

    def flush_buffer(*shape, device=None, **kwargs):  # the flush buffer, on the CPU here
        assert device == "cuda"
        buf = real_empty(*shape, **kwargs)
        real_zero = buf.zero_

        def zero_():
            calls.append("flush")
            clock["now"] += 100.0  # outside every call's events
            return real_zero()
        buf.zero_ = zero_
        return buf
    monkeypatch.setattr(torch, "empty", flush_buffer)

    def provider(name, cost, first_cost=None):
        def call():
            first = calls[-2] == "sync" if len(calls) >= 2 else True  # a sample's first call
            calls.append(name)
            clock["now"] += first_cost if (first and first_cost is not None) else cost
        return call

    # "c"'s first call of each sample is slow: per call, the median is its usual 0.5 (the median
    # of per-sample means would be 2.5)
    times = bench_timing.interleaved_ms({"a": provider("a", 1.0), "b": provider("b", 3.0), "c": provider("c", 0.5, 6.5)},
                                        warmup=1, reps=4, calls=3)
    assert times == {"a": 1.0, "b": 3.0, "c": 0.5}
    assert calls[:4] == ["a", "b", "c", "sync"]  # warm-up
    sample = {name: ["flush", name] * 3 + ["sync"] for name in "abc"}
    forward = sample["a"] + sample["b"] + sample["c"]
    backward = sample["c"] + sample["b"] + sample["a"]
    assert calls[4:] == (forward + backward) * 2  # a wait before each sample, a flush before each call


def test_sparse_forced_forces_the_sparse_path_for_one_call_only():
    """``sparse_forced(fn)``: the op's sparse path forced while ``fn`` runs (its value returned),
    and the policy back in charge afterwards, even when ``fn`` raises."""
    from twell_compile.lowering import dispatch_policy

    seen = []
    assert bench.sparse_forced(lambda: seen.append(dispatch_policy.FORCED_PATH) or 7)() == 7
    assert seen == ["sparse"] and dispatch_policy.FORCED_PATH is None

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        bench.sparse_forced(fail)()
    assert dispatch_policy.FORCED_PATH is None


def test_host_training_step_reaches_the_ops_as_compiled_code_and_as_autograd_alike():
    """The host line's training step, on the CPU reference: called as a compiled model's graphs call
    the ops (grad mode off, ``ffn_bwd`` in reverse) and through eager autograd, its chained layers
    give the same input gradient, which is the dense FFN chain's (float64 autograd, L1 term
    included)."""
    d, h, m = 16, 64, 24
    steps = {route: bench._training_step(d, h, route, m=m, dtype=torch.float64, device="cpu") for route in bench.HOST_ROUTES}
    grads = {route: step() for route, step in steps.items()}
    assert torch.equal(grads["compiled"], grads["autograd"])
    problems = [bench.make_problem(m, d, h, 0.005, skewed=False, dtype=torch.float64, device="cpu", seed=i)
                for i in range(bench.HOST_LAYERS)]
    x = problems[0][0].clone().requires_grad_()
    y, l1 = x, 0.0
    for _, wg, wu, wd in problems:
        hidden = torch.relu(y @ wg.T) * (y @ wu.T)
        l1 = l1 + hidden.abs().sum() / m
        y = hidden @ wd.T
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(bench.HOST_LAYERS)).to(torch.float64)
    ((y * dout).sum() + 2e-5 * l1).backward()
    torch.testing.assert_close(grads["compiled"], x.grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="host route"):
        bench._training_step(d, h, "jit", device="cpu")
