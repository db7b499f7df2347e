"""``twell bench``: TwELL against dense, measured side by side in one process (docs/benchmarks.md,
'Floors and targets').

Setup, shared by every provider: a gated bf16 FFN (default D=2048, H=5632, M=16384 tokens) whose
density of active gate units is controlled by a constant feature ``x[:, 0] = 1`` and a gate weight
column set to minus the normal quantile of the target density (per neuron in the skewed variant).
Inputs are random, never zeros. ``--heavy-rows N`` also makes N evenly spaced tokens active on
~all neurons (like the outlier tokens of real models): their tiles overflow, so the forward and
the backward compute those rows densely, which the uniform problem never exercises.

Providers: dense eager (cuBLAS through PyTorch), dense ``torch.compile`` (Inductor), the TwELL op
as dispatched (``torch.ops.twell.ffn`` for inference; ``ffn_train`` forward + backward with the L1
term for training; its per-layer policy picks the sparse or the dense path), and the TwELL op with
the Triton sparse path forced on. Times are per-call medians of CUDA-event times after warm-up,
the providers' samples interleaved and each call after an L2 flush (``interleaved_ms``); speedups
are dense eager time ÷ TwELL time, from the same run. Each point also reports the relative error against a
float64 reference and, for training, the peak memory of one step. Every timed training step ends
as an optimizer step would for the weights' version counters (their values stay the same), so
per-weight work the op redoes after each update (its ``Wdᵀ`` copy and guard bounds) is timed as
in real training. With ``--graphs``, dense eager and the TwELL op as dispatched are also each
captured in one CUDA graph and their replays timed: the GPU's time, without the host's launches.
With ``--floors``, each inference point up to 5% density also times its floor: the gate GEMM alone and
a bare gather of the bytes the sparse part reads (the kernels' ``gather_floor``), in the same
interleaved samples.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .bench_report import Row, eager_reasons, print_floors, print_table, write_csv, write_outputs
from .bench_timing import graphed, interleaved_ms, peak_mb, rel_error, weights_updated
from .lowering import (DEFAULT_LAYOUT, TILE_N, active_pairs, force_path, gather_floor, replay_stats, replays_off,
                       tuned_configs)
from .options import COMPILE_MODES

DEFAULT_DENSITIES = (0.003, 0.005, 0.01, 0.02, 0.05, 0.2, 0.5)
# ``--floors`` only up to this density: past it most rows overflow a TwELL tile's slots and the op
# computes them densely, so a gather of every pair is no floor of what it does
FLOOR_MAX_DENSITY = 0.05
E2E_DENSITIES = (0.003, 0.005, 0.02)  # each point compiles the whole model twice per mode


def overflow_row_ids(m: int, n: int) -> torch.Tensor:
    """The ``n`` tokens ``make_problem`` makes overflow: one in the middle of each ``m / n`` stretch
    (so late tokens too, and none of the heavy rows' stretch ends)."""
    return (torch.arange(n) * 2 + 1) * m // (2 * max(n, 1))


def make_problem(m: int, d: int, h: int, density: float, *, skewed: bool, heavy_rows: int = 0, overflow_rows: int = 0,
                 overflow_tiles: int = 2, dtype=torch.bfloat16, device="cuda", seed: int = 0):
    """x, wg, wu, wd whose gate is active with probability ``density`` (per neuron if skewed).

    ``heavy_rows`` evenly spaced tokens get the constant feature -1 instead of 1, which flips the
    gate bias column: they are active with probability ``1 - density`` per neuron.

    ``overflow_rows`` tokens (``overflow_row_ids``) are active on every neuron of
    ``overflow_tiles`` evenly spaced TwELL tiles of ``TILE_N`` columns, which then overflow (the
    sparse path computes those rows densely), and sparse elsewhere: a second constant feature, 1 in
    those rows and 0 in the others, with gate weights that switch those tiles' neurons on.
    """
    if not 0 <= heavy_rows <= m:
        raise ValueError(f"heavy_rows must be in 0..M={m}, got {heavy_rows}")
    n_tiles = DEFAULT_LAYOUT.n_tiles(h)
    if not 0 <= overflow_rows <= m:
        raise ValueError(f"overflow_rows must be in 0..M={m}, got {overflow_rows}")
    if overflow_rows and not 1 <= overflow_tiles <= n_tiles:
        raise ValueError(f"overflow_tiles must be in 1..{n_tiles} (the tiles of H={h}), got {overflow_tiles}")
    if overflow_rows and d < 3:
        raise ValueError(f"overflow_rows needs D >= 3 (two constant features), got D={d}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, d, generator=gen)
    x[:, 0] = 1.0
    if heavy_rows:
        x[torch.linspace(0, m - 1, heavy_rows).round().long(), 0] = -1.0
    if overflow_rows:
        x[:, 1] = 0.0
        x[overflow_row_ids(m, overflow_rows), 1] = 1.0
    scale = 1.0 / math.sqrt(d)
    wg = torch.randn(h, d, generator=gen) * scale
    wu = torch.randn(h, d, generator=gen) * scale
    wd = torch.randn(d, h, generator=gen) * (1.0 / math.sqrt(h))
    random_features = d - (2 if overflow_rows else 1)
    sigma = math.sqrt(random_features) * scale  # std of the gate pre-activation over the random features
    if skewed:
        # Per-neuron densities, log-normal around the target: a few hot neurons, many cold ones.
        p = (torch.randn(h, generator=gen) * 1.0).exp()
        p = (p / p.mean() * density).clamp(1e-6, 0.999)
    else:
        p = torch.full((h,), density)
    normal = torch.distributions.Normal(0.0, 1.0)
    wg[:, 0] = -normal.icdf(1 - p) * sigma
    if overflow_rows:
        tiles = torch.linspace(0, n_tiles - 1, overflow_tiles).round().long()
        cols = (tiles[:, None] * TILE_N + torch.arange(TILE_N)).flatten()
        cols = cols[cols < h]
        wg[:, 1] = 0.0
        wg[cols, 1] = -wg[cols, 0] + 8 * sigma  # cancels the bias, 8 sigma over: active
    return [t.to(device=device, dtype=dtype) for t in (x, wg, wu, wd)]


def dense_ffn(x, wg, wu, wd):
    return F.linear(torch.relu(F.linear(x, wg)) * F.linear(x, wu), wd)


def dense_train_step(x, wg, wu, wd, dout, l1_coeff):
    """Dense forward + backward of ``out·dout + l1_coeff · (1/T) Σ|h|``."""
    h = torch.relu(F.linear(x, wg)) * F.linear(x, wu)
    out = F.linear(h, wd)
    loss = (out * dout).sum() + l1_coeff * h.abs().sum() / x.shape[0]
    loss.backward()


def twell_train_step(x, wg, wu, wd, dout, coeff):
    out = torch.ops.twell.ffn_train(x, wg, wu, wd, None, None, None, coeff, torch.ones_like(coeff), 10_000)[0]
    out.backward(dout)


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# Host time a call may take, in ms, at M=512: the project's targets, printed beside each
# measurement. Below them the ops' host work hides behind the GPU's from ~4096 tokens at the 2B
# FFN shape (docs/benchmarks.md, "Host time of the TwELL ops").
HOST_TARGETS_MS = {("sparse", False): 0.15, ("sparse", True): 0.5, ("dense", False): 0.1}
HOST_LABELS = {("sparse", False): "a sparse inference call", ("sparse", True): "a sparse training step per layer",
               ("dense", False): "a dense inference call"}
# Calls per timed round of host_ms (training: steps of HOST_LAYERS layers). Behind the spin every
# launch waits in CUDA's queue, which holds ~1000 of them; a full queue would make the host wait
# for the spin. 50 inference calls queue ~300 launches, 10 training steps ~400.
HOST_CALLS = {False: 50, True: 10}
# Layers a timed training step chains, as a model does: what a step pays once (the autograd
# engine's start, the loss) is shared by its layers, and each layer has its own weights and keys.
HOST_LAYERS = 4
# How a training step reaches the ops: as a model compiled with backend="twell" calls them (the
# compiled forward and backward call ``ffn_train`` and ``ffn_bwd`` with grad mode off, no autograd
# node per layer), or through eager autograd (a patched model that is not compiled).
HOST_ROUTES = ("compiled", "autograd")


def spin_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond on the current device, timed."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def _training_step(d: int, h: int, route: str, *, m: int = 512, dtype=torch.bfloat16,
                   device: str = "cuda") -> Callable[[], torch.Tensor]:
    """One training step of ``HOST_LAYERS`` chained FFNs of ``m`` tokens (forward, backward,
    weights updated), reaching the ops by ``route`` (``HOST_ROUTES``); it returns the gradient of
    the first layer's input."""
    if route not in HOST_ROUTES:
        raise ValueError(f"twell bench: host route must be one of {HOST_ROUTES}, got {route!r}")
    layers = [make_problem(m, d, h, 0.005, skewed=False, dtype=dtype, device=device, seed=i) for i in range(HOST_LAYERS)]
    x = layers[0][0].detach().requires_grad_(route == "autograd")
    weights = [[w.detach().requires_grad_() for w in problem[1:]] for problem in layers]
    gen = torch.Generator(device="cpu").manual_seed(HOST_LAYERS)
    dout = torch.randn(x.shape, generator=gen).to(device=device, dtype=dtype)
    coeff = torch.tensor(2e-5, device=device)
    factor = torch.ones_like(coeff)
    # Layer ids of the route's own: another step's weights under the same ids would read as weights
    # that moved, whose graphs then copy them in (``call_replay``), as autocast's copies do.
    ids = [10_000 + 10 * HOST_ROUTES.index(route) + i for i in range(HOST_LAYERS)]
    flat = [w for ws in weights for w in ws]

    def compiled() -> torch.Tensor:
        with torch.no_grad():
            inputs, saved, y = [], [], x
            for (wg, wu, wd), layer in zip(weights, ids):
                inputs.append(y)
                y, *buffers = torch.ops.twell.ffn_train(y, wg, wu, wd, None, None, None, coeff, factor, layer)
                saved.append(buffers)
            grad = dout
            for (wg, wu, wd), layer, xi, buffers in reversed(list(zip(weights, ids, inputs, saved))):
                grad = torch.ops.twell.ffn_bwd(grad, xi, wg, wu, wd, None, None, None, *buffers, coeff, factor, layer)[0]
        weights_updated(flat)
        return grad

    def autograd() -> torch.Tensor:
        y = x
        for (wg, wu, wd), layer in zip(weights, ids):
            y = torch.ops.twell.ffn_train(y, wg, wu, wd, None, None, None, coeff, factor, layer)[0]
        y.backward(dout)
        grad, x.grad = x.grad, None
        for w in flat:  # optimizer.zero_grad(set_to_none=True)
            w.grad = None
        weights_updated(flat)
        return grad

    return compiled if route == "compiled" else autograd


def host_ms(d: int, h: int, *, train: bool, path: str = "sparse", route: str = "compiled", reps: int = 5) -> float:
    """Host time of a TwELL call forced onto ``path`` at M=512 tokens (ms, median of ``reps``
    rounds of ``HOST_CALLS`` calls): an inference call, or a training step's share per layer
    (``HOST_LAYERS`` chained layers: forward, backward, weights updated; reaching the ops by
    ``route``).

    Each round first queues a GPU spin (``torch.cuda._sleep``) three times as long as an untimed
    round took, so the host never waits for the GPU and the clock times its work alone (Python,
    dispatch, allocations, launches), whatever the calls' GPU time. A call that synchronises with
    the GPU would wait for the spin: that raises. Near 0.5% density at the benchmark shape a sparse
    call's GPU work is about as long as its host's work, which differs by 1.5-2x between the H200's
    hosts: this says how fast this run's was, and so whether its eager readings were the host's."""
    if train:
        call, per_call = _training_step(d, h, route), HOST_LAYERS
    else:
        x, wg, wu, wd = make_problem(512, d, h, 0.005, skewed=False)
        per_call = 1

        def call():
            with torch.no_grad():
                torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, 10_002)

    calls = HOST_CALLS[train]
    spun = torch.cuda.Event()
    with force_path(path):
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):  # untimed: sizes the spin (host and GPU time together)
            call()
        torch.cuda.synchronize()
        spin = int(spin_cycles_per_ms() * max(20.0, 3e3 * (time.perf_counter() - t)))
        times = []
        for _ in range(reps):
            torch.cuda._sleep(spin)
            spun.record()
            t = time.perf_counter()
            for _ in range(calls):
                call()
            times.append((time.perf_counter() - t) / (calls * per_call) * 1e3)
            if spun.query():
                raise RuntimeError(f"the GPU finished a spin 3x as long as an untimed round before the host finished "
                                   f"{calls} calls ({times[-1] * calls * per_call:.1f} ms): a call waited for the GPU "
                                   "(a host sync)")
            torch.cuda.synchronize()
    return statistics.median(times)


def host_line(d: int, h: int) -> str:
    """The benchmark's host line: CPU model, cores, and ``host_ms`` of each call in
    ``HOST_TARGETS_MS`` beside its target; the training step as compiled models call the ops,
    then through eager autograd."""
    measured = []
    for (path, train), target in HOST_TARGETS_MS.items():
        label = HOST_LABELS[path, train]
        try:
            ms, note = _host_reading(d, h, train=train, path=path)
            eager = ""
            if train:
                autograd_ms, autograd_note = _host_reading(d, h, train=train, path=path, route="autograd")
                eager = f"; {autograd_ms:.3f} ms{autograd_note} through eager autograd"
        except Exception as err:  # noqa: BLE001 - a report line: say what failed, keep the results
            measured.append(f"{label} not measured ({type(err).__name__}: {err})")
            continue
        verdict = "met" if ms <= target else f"{ms / target:.1f}x over"
        measured.append(f"{label} {ms:.3f} ms{note} (target {target:g}: {verdict}{eager})")
    return (f"host: {cpu_model()}, {os.cpu_count()} cores; host time of a forced call at M=512, D={d}, H={h} "
            f"(GPU kept busy; a training step of {HOST_LAYERS} chained layers, its ops called as a model compiled "
            f"with backend='twell' calls them): {', '.join(measured)}")


def _host_reading(d: int, h: int, **how) -> tuple[float, str]:
    """``host_ms``, and what its reading must say when some of its forward calls ran eagerly though
    they could have been replayed (say, a training run before it spent the graphs' memory share):
    those were timed as eager calls, not replayed ones."""
    before = replay_stats().outcomes
    ms = host_ms(d, h, **how)
    return ms, _eager_note(before, replay_stats().outcomes)


def _eager_note(before: dict, after: dict) -> str:
    grown = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
    grown.pop("forward eager: first call of its key", None)  # every reading warms its keys up first
    eager, reasons = eager_reasons(grown, "forward")
    if not eager:
        return ""
    return f" [{eager} of its {eager + grown.get('forward replayed', 0)} forward calls ran eagerly: {reasons}]"


def sparse_forced(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the sparse path forced for its duration only (to interleave it with others)."""
    def call() -> object:
        with force_path("sparse"):
            return fn()
    return call


def _graphed_ms(dense: Callable[[], object], twell: Callable[[], object], reps: int) -> tuple[float, float]:
    """Dense and TwELL times, each provider captured in a CUDA graph and their replays interleaved
    (``interleaved_ms``); NaN, with the reason on stderr, if a capture fails (the other columns
    stand)."""
    try:
        times = interleaved_ms({"dense": graphed(dense), "twell": graphed(twell)}, reps=reps)
        return times["dense"], times["twell"]
    except Exception as err:  # noqa: BLE001 - a report column: say what failed, keep the point
        print(f"twell bench: CUDA-graph timing failed ({type(err).__name__}: {err})", file=sys.stderr)
        return float("nan"), float("nan")


def bench_point(m, d, h, density, *, skewed, train, compiled_cache, reps, max_sparse_train_density, l1_coeff=2e-5,
                heavy_rows: int = 0, overflow_rows: int = 0, overflow_tiles: int = 2, graphs: bool = False,
                floors: bool = False) -> Row:
    x, wg, wu, wd = make_problem(m, d, h, density, skewed=skewed, heavy_rows=heavy_rows, overflow_rows=overflow_rows,
                                 overflow_tiles=overflow_tiles)
    floor_fns = {}
    with torch.no_grad():
        active = F.linear(x, wg) > 0
        measured = active.float().mean().item()
        if floors and not train and density <= FLOOR_MAX_DENSITY:
            floor_fns = _floor_providers(x, wg, wu, wd, active)
        del active
        ref = dense_ffn(x.double(), wg.double(), wu.double(), wd.double())
        dense_out = dense_ffn(x, wg, wu, wd)
        # the error column is the sparse kernels'
        twell_out = sparse_forced(lambda: torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, 10_000))()
    err_twell, err_dense = rel_error(twell_out, ref), rel_error(dense_out, ref)
    del ref, dense_out, twell_out
    g_dense = g_twell = float("nan")
    compiled = compiled_cache.setdefault(("train" if train else "infer"), torch.compile(dense_train_step if train else dense_ffn))
    if not train:
        with torch.no_grad():
            t = interleaved_ms({
                "eager": lambda: dense_ffn(x, wg, wu, wd),
                "compiled": lambda: compiled(x, wg, wu, wd),
                "twell": lambda: torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, 10_000),
                "sparse": sparse_forced(lambda: torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, 10_001)),
                **floor_fns,
            }, reps=reps)
            t_eager, t_comp, t_twell, t_sparse = t["eager"], t["compiled"], t["twell"], t["sparse"]
            if graphs:
                g_dense, g_twell = _graphed_ms(lambda: dense_ffn(x, wg, wu, wd),
                                               lambda: torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, 10_000), reps)
        mem_dense = mem_twell = float("nan")
    else:
        params = [t.detach().requires_grad_() for t in (x, wg, wu, wd)]
        dout = torch.randn_like(x)
        coeff = torch.tensor(l1_coeff, device=x.device)
        weights = params[1:]
        providers = {
            "eager": lambda: (dense_train_step(*params, dout, l1_coeff), weights_updated(weights)),
            "compiled": lambda: (compiled(*params, dout, l1_coeff), weights_updated(weights)),
            "twell": lambda: (twell_train_step(*params, dout, coeff), weights_updated(weights)),
        }
        sparse_timed = measured <= max_sparse_train_density  # the forced sparse backward is slow when dense
        if sparse_timed:
            providers["sparse"] = sparse_forced(providers["twell"])
        t = interleaved_ms(providers, reps=reps)
        t_eager, t_comp, t_twell = t["eager"], t["compiled"], t["twell"]
        mem_dense = peak_mb(lambda: dense_train_step(*params, dout, l1_coeff))
        if graphs:
            g_dense, g_twell = _graphed_ms(lambda: dense_train_step(*params, dout, l1_coeff),
                                           lambda: twell_train_step(*params, dout, coeff), reps)
        t_sparse = mem_twell = float("nan")
        if sparse_timed:
            t_sparse = t["sparse"]
            # an eager step's peak: a replayed step allocates nothing per call, its graphs hold about this for good
            with replays_off():
                mem_twell = peak_mb(sparse_forced(lambda: twell_train_step(*params, dout, coeff)))
    return Row(
        "training" if train else "inference", m, d, h, "skewed" if skewed else "uniform", density, measured, measured * h,
        t_eager, t_comp, t_twell, t_sparse, t_eager / t_twell, t_comp / t_twell, t_eager / t_sparse, err_twell, err_dense, mem_dense, mem_twell,
        heavy_rows, overflow_rows, overflow_tiles if overflow_rows else 0, g_dense, g_twell, g_dense / g_twell,
        t.get("gate GEMM", float("nan")), t.get("gather", float("nan")),
    )


def _floor_providers(x, wg, wu, wd, active) -> dict[str, Callable[[], object]]:
    """``--floors``: the two parts of the inference op at their floors, as providers for
    ``interleaved_ms``: the gate GEMM alone (cuBLAS, no ReLU, no packing) and ``gather_floor`` over
    the problem's active pairs (the bytes ``sparse_ffn`` must read, with none of its arithmetic)."""
    row_ptr, cols = active_pairs(active)
    wd_t = wd.t().contiguous()  # the op keeps this copy too
    return {"gate GEMM": lambda: F.linear(x, wg), "gather": lambda: gather_floor(x, row_ptr, cols, wu, wd_t)}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--train" in argv:  # a model trained from scratch: its own flags (bench_train.py)
        from .bench_train import main as train_main

        return train_main(argv, host_line=host_line)
    parser = argparse.ArgumentParser(prog="twell bench", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--m", type=int, nargs="+", default=[16384], help="token counts (default 16384)")
    parser.add_argument("--d", type=int, default=2048, help="model dimension D (default 2048)")
    parser.add_argument("--h", type=int, default=5632, help="hidden dimension H (default 5632)")
    parser.add_argument("--densities", type=float, nargs="+", default=None,
                        help=f"target densities of h (fractions; default {' '.join(map(str, DEFAULT_DENSITIES))}, "
                             f"with --e2e {' '.join(map(str, E2E_DENSITIES))})")
    parser.add_argument("--modes", nargs="+", choices=["inference", "training"], default=["inference", "training"])
    parser.add_argument("--skewed", action="store_true", help="also run per-neuron skewed densities")
    parser.add_argument("--heavy-rows", type=int, nargs="+", default=[0], metavar="N",
                        help="tokens per problem active on ~all neurons, which the sparse path computes densely (default 0; several values: one run each)")
    parser.add_argument("--overflow-rows", type=int, nargs="+", default=[0], metavar="N",
                        help="tokens per problem active on every neuron of --overflow-tiles TwELL tiles only, which overflow (default 0; several values: one run each)")
    parser.add_argument("--overflow-tiles", type=int, default=2, metavar="K",
                        help="tiles of 128 columns each --overflow-rows token overflows (default 2)")
    parser.add_argument("--reps", type=int, default=30,
                        help="samples per provider and point, of 5 calls each, each call timed alone (median call reported)")
    parser.add_argument("--max-sparse-train-density", type=float, default=0.021, help="time the forced sparse training path only up to this density (it is slow when dense)")
    parser.add_argument("--graphs", action="store_true",
                        help="also time dense eager and the TwELL op each captured in one CUDA graph, which takes the host's "
                             "launch time out of the step (what torch.compile's reduce-overhead mode does)")
    parser.add_argument("--floors", action="store_true",
                        help="inference points up to 5%% density: also time the floor of each part of the op, interleaved "
                             "with the rest: the gate GEMM alone (cuBLAS) and a bare gather of the weight rows the sparse "
                             "part reads; their sum is what the op would take with both parts at those rates")
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for bench.csv, the PNG plot, host.txt and tuned.txt")
    parser.add_argument("--train", action="store_true",
                        help="a model trained from scratch, twell against Inductor (its own flags: twell bench --train --help)")
    e2e = parser.add_argument_group("end to end (--e2e): a Hugging Face Llama, backend='twell' against 'inductor'")
    e2e.add_argument("--e2e", action="store_true", help="benchmark the whole model instead of one FFN block")
    e2e.add_argument("--layers", type=int, default=38, help="decoder layers (default 38, the paper's 2B model)")
    e2e.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    e2e.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    e2e.add_argument("--iters", type=int, default=10, help="timed steps per point (default 10)")
    e2e.add_argument("--warmup", type=int, default=40,
                     help="steps before the timed ones (default 40: twell's graph variants measure and settle)")
    e2e.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                     help="torch.compile mode of both backends (default: default; reduce-overhead: CUDA graphs)")
    e2e.add_argument("--lr", type=float, default=0.0,
                     help="AdamW learning rate of the training steps (default 0: the weights, and so the calibrated density, stay put)")
    args = parser.parse_args(argv)
    for flag in ("layers", "batch", "seq", "iters", "reps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    for flag, values in (("heavy-rows", args.heavy_rows), ("overflow-rows", args.overflow_rows)):
        bad_rows = [n for n in values for m in args.m if not 0 <= n <= m]
        if bad_rows:
            parser.error(f"--{flag} must be in 0..M for every --m (smallest M: {min(args.m)}), got {bad_rows[0]}")
    n_tiles = DEFAULT_LAYOUT.n_tiles(args.h)
    if any(args.overflow_rows) and not 1 <= args.overflow_tiles <= n_tiles:
        parser.error(f"--overflow-tiles must be in 1..{n_tiles} (the tiles of H={args.h}), got {args.overflow_tiles}")
    if args.densities is None:
        args.densities = list(E2E_DENSITIES if args.e2e else DEFAULT_DENSITIES)
    bad = [p for p in args.densities if not 0.0 < p < 1.0]
    if bad:
        parser.error(f"--densities must be fractions in (0, 1), got {bad[0]}")
    if not torch.cuda.is_available():
        print("twell bench: needs a CUDA GPU (none found); the CPU path is a reference, not a benchmark", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.e2e:
        return _main_e2e(args)
    compiled_cache: dict = {}
    rows: list[Row] = []
    variants = [False, True] if args.skewed else [False]
    points = [(mode, m, sk, hr, ov, p) for mode in args.modes for m in args.m for sk in variants for hr in args.heavy_rows
              for ov in args.overflow_rows for p in args.densities]
    try:
        from tqdm import tqdm

        points_iter = tqdm(points, desc="twell bench", file=sys.stderr)
    except ImportError:
        points_iter = points
    t0 = time.time()
    for mode, m, skewed, heavy, overflow, density in points_iter:
        rows.append(bench_point(m, args.d, args.h, density, skewed=skewed, train=(mode == "training"), compiled_cache=compiled_cache,
                                reps=args.reps, max_sparse_train_density=args.max_sparse_train_density, heavy_rows=heavy,
                                overflow_rows=overflow, overflow_tiles=args.overflow_tiles, graphs=args.graphs,
                                floors=args.floors))
        torch.cuda.empty_cache()
    host = host_line(args.d, args.h)  # after the points, so that its calls cannot steer their policy
    print(f"\ntwell bench on {torch.cuda.get_device_name()} (torch {torch.__version__}), gated FFN bf16, D={args.d}, H={args.h}; {time.time() - t0:.0f} s")
    print(host)
    print_table(rows)
    print_floors(rows)
    for path in write_outputs(rows, args.out):
        print(f"wrote {path}")
    (args.out / "host.txt").write_text(host + "\n")
    print(f"wrote {args.out / 'host.txt'}")
    print(f"wrote {write_tuned(args.out / 'tuned.txt')}")
    return 0


def write_tuned(path: Path) -> Path:
    """The autotuner's choices of this process (``tuned_configs``), one per line. The first point
    tuned decides each kernel's config for every later point of the same shapes."""
    lines = [f"{kernel}  {key}  ->  {config}" for kernel, key, config in tuned_configs()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" if lines else "no kernel was autotuned through kernels.launch\n")
    return path


def _main_e2e(args) -> int:
    from .bench_e2e import PAPER_2B, format_table, run

    t0 = time.time()
    csv_path = args.out / "e2e.csv"
    rows = run(args.densities, layers=args.layers, batch=args.batch, seq=args.seq, modes=tuple(args.modes),
               iters=args.iters, warmup=args.warmup, lr=args.lr, compile_mode=args.compile_mode, log=lambda line: print(line, flush=True),
               on_point=lambda so_far: write_csv(so_far, csv_path))  # saved per density: a run takes minutes
    print(f"\ntwell bench --e2e on {torch.cuda.get_device_name()} (torch {torch.__version__}), compile mode "
          f"{args.compile_mode}; {time.time() - t0:.0f} s")
    print(host_line(PAPER_2B["hidden_size"], PAPER_2B["intermediate_size"]))
    print(format_table(rows))
    print(f"wrote {csv_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
