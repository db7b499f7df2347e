"""``twell bench --e2e``: a Hugging Face Llama end to end, ``backend="twell"`` against Inductor.

See docs/benchmarks.md, 'Floors and targets'. The model is ``LlamaForCausalLM`` in the paper's 2B
shape (hidden 2048, intermediate 5632, 38 layers, 32 heads, vocab 49152) with
``hidden_act="relu"`` and ``mlp_bias=True``, randomly initialised. A random model is ~50% dense,
so each gate bias is set (``calibrate_gate_biases``) to put every neuron at the target density on
a calibration batch, one layer after the other, since each layer's bias shifts the inputs of the
next.

Measured, for each density and both backends (both ``torch.compile``d in the same process):

* inference: tokens/s of the backbone (``model.model``, no LM head) on ``batch × seq`` tokens,
  under ``torch.no_grad()``;
* training: tokens/s of a step: forward with labels, backward, AdamW step (twell adds its L1
  gradient; the loss is the language-model loss either way). The step runs AdamW in full, with a
  learning rate of 0 by default (``lr``): on a random model the language-model loss drives the
  density up within a few steps (measured on the H200, 8 layers calibrated to 0.5%: the last
  layer at 1.7% after 8 AdamW steps at lr 1e-5), so updated weights would time another density
  than the one calibrated. The optimizer's work per step is the same at any learning rate.

Also reported: the measured density of ``h`` (twell's per-layer counters), how many layers
ran the sparse path, and the rows per layer that the sparse path computed densely (overflowed
tiles: a few such rows cost the backward far more than their share). Timing is the median of
``iters`` steps after warm-up, each step's wall time synchronised at both ends (CUDA events would
miss host-bound stretches between kernels).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

PAPER_2B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=38, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=49152)


@dataclass
class E2ERow:
    mode: str  # "inference" or "training"
    target_density: float
    measured_density: float  # mean over layers of active units / H, from twell's counters
    sparse_layers: int  # layers whose last call took the sparse path
    dense_rows: float  # mean over layers of the rows the last call computed densely
    layers: int
    tokens: int  # per step
    inductor_tok_s: float
    twell_tok_s: float
    speedup: float  # twell ÷ inductor tokens/s
    compile_mode: str = "default"  # torch.compile's mode, the same for both backends


def llama_config(**overrides):
    """The paper's 2B Llama shape with ReLU MLPs and MLP biases (``overrides`` for smaller runs)."""
    from transformers import LlamaConfig

    shape = {**PAPER_2B, **overrides}
    return LlamaConfig(hidden_act="relu", mlp_bias=True, attention_dropout=0.0,
                       max_position_embeddings=max(2048, shape.pop("max_position_embeddings", 2048)), **shape)


class _Stop(Exception):
    pass


@torch.no_grad()
def calibrate_gate_biases(model, tokens: torch.Tensor, density: float) -> list[float]:
    """Set every ``mlp.gate_proj.bias`` so each neuron is active on ``density`` of ``tokens``.

    Layer by layer: run the model up to layer ``l``'s gate projection (stopping there), then shift
    that layer's bias by the per-neuron order statistic at ``1 - density``. Returns the fraction
    of active gate units per layer on the calibration batch, after calibration.
    """
    if not 0.0 < density < 1.0:
        raise ValueError(f"density must be in (0, 1), got {density}")
    layers = model.model.layers
    achieved = []
    for layer in layers:
        gate = layer.mlp.gate_proj
        captured = {}

        def hook(_mod, _args, out, captured=captured):
            captured["pre"] = out.reshape(-1, out.shape[-1]).float()
            raise _Stop

        handle = gate.register_forward_hook(hook)
        try:
            model.model(tokens)
        except _Stop:
            pass
        finally:
            handle.remove()
        pre = captured["pre"]
        n = pre.shape[0]
        k = min(n, max(1, n - round(density * n)))  # k-th smallest: the top n-k stay positive
        threshold = pre.kthvalue(k, dim=0).values
        gate.bias.sub_(threshold.to(gate.bias.dtype))
        achieved.append(((pre - threshold) > 0).float().mean().item())
    return achieved


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tokens_per_s(step: Callable[[], object], tokens: int, warmup: int, iters: int,
                  log: Callable[[str], None] = print, label: str = "") -> float:
    """Tokens per second of the median step, each step timed alone (synchronised at both ends).

    A median, not the mean over the steps: a one-time stall in a timed step (a kernel's first
    autotuning, a recompile) would otherwise set the number. Steps over 1.5x the median are
    logged (on the H200 the mean of 5 steps put the 2B Llama's twell training step at 0.68x of
    Inductor, where the same model timed alone ran 428-437 ms per step after its second).
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        _sync()
        start = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    slow = [f"{1e3 * t:.0f}" for t in times if t > 1.5 * median]
    if slow:
        log(f"  {label}: {len(slow)} of {iters} timed steps over 1.5x the median step ({1e3 * median:.0f} ms): "
            f"{', '.join(slow)} ms")
    return tokens / median


def _variant_note() -> str:
    """Which of twell's graph variants ran (variants.py), and the step times it measured."""
    from . import variants

    notes = []
    for c in variants.coordinators():
        measured = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(c.periods.items()))
        notes.append(f"{c.current} variant" + (f" (measured {measured})" if measured else ""))
    return f"  [{'; '.join(notes)}]" if notes else ""


def _check_compile_mode(compile_mode: str) -> None:
    from .options import COMPILE_MODES

    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")


# Warm-up steps before the timed ones: enough for twell's graph variants to measure both and settle
# (variants.py: 2 x (3 + 8) steps once the layers' density is known).
WARMUP_STEPS = 40


def run_point(base, density: float, *, batch: int, seq: int, modes=("inference", "training"), warmup: int = WARMUP_STEPS,
              iters: int = 10, baseline: str = "inductor", l1_coeff: float = 2e-5, lr: float = 0.0, device: str = "cuda",
              compile_mode: str = "default", log: Callable[[str], None] = print) -> list[E2ERow]:
    """Calibrate ``base`` (in place) for ``density`` and time both backends on it, both compiled in
    ``compile_mode`` (``"reduce-overhead"``: CUDA graphs, each step begun by
    ``torch.compiler.cudagraph_mark_step_begin``)."""
    import twell_compile

    from .backend import uses_cuda_graphs

    _check_compile_mode(compile_mode)
    mark_step = torch.compiler.cudagraph_mark_step_begin if uses_cuda_graphs(compile_mode) else (lambda: None)

    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = base.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    achieved = calibrate_gate_biases(base, tokens, density)
    log(f"  calibrated gate biases for {density:.2%}: {min(achieved):.2%}..{max(achieved):.2%} per layer on the calibration batch")
    rows = []
    n_tokens = batch * seq
    for mode in modes:
        speeds = {}
        for backend in (baseline, "twell"):
            torch._dynamo.reset()
            twell_compile.reset()
            if backend == "twell":  # torch.compile takes mode or options, not both: the mode as an option
                options = {"l1_coeff": l1_coeff} if mode == "training" else {}
                if compile_mode != "default":
                    options["mode"] = compile_mode
                kwargs = {"options": options} if options else {}
            else:
                kwargs = {"mode": compile_mode} if compile_mode != "default" else {}
            if mode == "inference":
                model = base.eval()
                compiled = torch.compile(model.model, backend=backend, **kwargs)

                def step(compiled=compiled):
                    mark_step()
                    with torch.no_grad():
                        return compiled(tokens)
            else:
                import copy

                model = copy.deepcopy(base).train()
                compiled = torch.compile(model, backend=backend, **kwargs)
                opt = torch.optim.AdamW(model.parameters(), lr=lr)

                def step(compiled=compiled, opt=opt):
                    mark_step()
                    loss = compiled(tokens, labels=tokens).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            speeds[backend] = tokens_per_s(step, n_tokens, warmup, iters, log, f"{mode} {backend}")
            log(f"  {mode:<9} {backend:<8} {speeds[backend]:,.0f} tokens/s" + (_variant_note() if backend == "twell" else ""))
            if backend == "twell":
                stats = twell_compile.stats()
                hidden = base.config.intermediate_size
                measured = sum(s.l0 for s in stats.layers) / max(1, len(stats.layers)) / hidden
                sparse_layers = sum(s.path == "sparse" for s in stats.layers)
                dense_rows = sum(s.dense_rows for s in stats.layers) / max(1, len(stats.layers))
                layers = len(stats.layers)
            del compiled, model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        rows.append(E2ERow(mode, density, measured, sparse_layers, dense_rows, layers, n_tokens, speeds[baseline], speeds["twell"],
                           speeds["twell"] / speeds[baseline], compile_mode))
    return rows


def run(densities, *, layers: int = 38, batch: int = 8, seq: int = 2048, modes=("inference", "training"),
        warmup: int = WARMUP_STEPS, iters: int = 10, lr: float = 0.0, device: str = "cuda", dtype=torch.bfloat16,
        config_overrides: Optional[dict] = None, baseline: str = "inductor", compile_mode: str = "default",
        log: Callable[[str], None] = print, on_point: Optional[Callable[[list[E2ERow]], None]] = None) -> list[E2ERow]:
    """The end-to-end benchmark over ``densities`` on one model (rebuilt per density).

    ``on_point`` gets the rows so far after each density (a point takes minutes: the caller can
    save them before a time limit cuts the run).
    """
    from transformers import LlamaForCausalLM

    _check_compile_mode(compile_mode)  # before minutes of model building
    rows = []
    for density in densities:
        torch.manual_seed(0)
        cfg = llama_config(num_hidden_layers=layers, max_position_embeddings=seq, **(config_overrides or {}))
        base = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
        log(f"density {density:.2%}: Llama {layers} layers, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
            f"{batch}x{seq} tokens, {dtype}")
        rows += run_point(base, density, batch=batch, seq=seq, modes=modes, warmup=warmup, iters=iters, lr=lr,
                          baseline=baseline, device=device, compile_mode=compile_mode, log=log)
        del base
        if on_point is not None:
            on_point(list(rows))
    return rows


def format_table(rows: list[E2ERow], baseline: str = "inductor") -> str:
    header = (f"{'mode':<9} {'density':>8} {'measured':>8} {'sparse layers':>13} {'dense rows':>10} {'tokens':>7} "
              f"{baseline + ' tok/s':>15} {'twell tok/s':>13} {'speedup':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        measured = "n/a" if math.isnan(r.measured_density) else f"{r.measured_density:.2%}"
        lines.append(f"{r.mode:<9} {r.target_density:>8.2%} {measured:>8} {f'{r.sparse_layers}/{r.layers}':>13} {r.dense_rows:>10.1f} {r.tokens:>7} "
                     f"{r.inductor_tok_s:>15,.0f} {r.twell_tok_s:>13,.0f} {r.speedup:>7.2f}x")
    return "\n".join(lines)
