"""``twell bench --train``: a model trained from scratch, twell against Inductor, in one process.

What a user runs: a Llama-style ``LlamaForCausalLM`` built from a config (randomly initialised, so
it starts ~50% dense), trained on byte-level text that every machine has (the Python standard
library's sources), AdamW, bf16 autocast, each variant ``torch.compile``d:

* ``inductor``: the same ReLU model with ``backend="inductor"`` (the baseline);
* ``twell``: ``backend="twell"`` with ``--l1`` (a fixed coefficient), or ``--target-density``
  (the coefficient steered to a density);
* ``twell-fixed``: ``backend="twell"`` with the default fixed coefficient (2e-5);
* ``silu-relu-gate``: a SiLU model (the standard Llama configuration) compiled with
  ``relu_gate=True`` and the same L1 settings as ``twell``: the paper's recipe with one flag;
* ``silu``: that SiLU model with ``backend="inductor"``.

All variants start from the same weights and see the same batches in the same order. They run in
turns of ``--eval-every`` steps, each turn back to back with no host sync inside it (as a training
loop runs between two loss readings), timed from a synchronised start to a synchronised end: the
step time a user sees, host stalls included. Every turn reports, per variant: the training loss
(mean over the turn), the validation loss (fixed held-out batches), the FFN density (per layer and
mean: twell's counters; for Inductor, measured with hooks on an eager forward of one validation
batch), each layer's path (sparse or dense), the L1 coefficient, dead neurons, the step time, and
on CUDA the process's peak memory during the turn and the memory reserved at its end (a jump is
what that turn recorded: CUDA graphs of a variant or of replayed calls).

Writes ``train.csv`` (one row per variant and turn) and ``train.png`` (validation loss, density,
coefficient, dead neurons, step time and speed against the first variant, against the step) into
``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import math
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .bench_report import eager_reasons

VARIANTS = ("inductor", "twell", "twell-fixed", "silu-relu-gate", "silu")


@dataclass
class TrainRow:
    step: int
    variant: str
    train_loss: float
    val_loss: float
    density: float  # mean over layers of active units / intermediate size
    density_per_layer: str  # ";"-separated, one per layer
    sparse_layers: int  # layers whose last call ran the sparse path (-1: not a twell variant)
    paths: str  # each layer's last path, in layer order: S sparse, D dense ("-": not a twell variant)
    layers: int
    l1_coeff: float  # mean over layers (NaN: not a twell variant)
    dead_neurons: float  # mean share per layer (NaN: not measured)
    graph_variant: str  # which of twell's graph variants ran at the end of the turn ("-": not twell)
    step_ms: float
    ratio: float  # the baseline's step time / this variant's (>1: faster than the baseline)
    # The process's CUDA memory (GiB; NaN off CUDA), with every variant's models, optimizer states and
    # recorded graphs in it: the most allocated during this variant's turn, and what the caching
    # allocator reserved at its end (a jump from one turn to the next is what that turn recorded).
    peak_gib: float = float("nan")
    reserved_gib: float = float("nan")


@dataclass
class TrainConfig:
    hidden: int = 768
    intermediate: int = 2048
    layers: int = 12
    heads: int = 12
    steps: int = 1000
    batch: int = 32
    seq: int = 512
    lr: float = 3e-4
    warmup_steps: int = 100
    l1_coeff: Optional[float] = None  # twell's fixed coefficient
    target_density: Optional[float] = None  # twell's steered density
    l1_coeff_max: Optional[float] = None  # the controller's ceiling
    compile_mode: str = "default"
    eval_every: int = 50
    val_batches: int = 8
    variants: tuple = ("inductor", "twell")
    baseline_backend: str = "inductor"  # tests use "aot_eager"
    twell_inner: str = "inductor"
    device: str = "cuda"
    seed: int = 0
    mlp_bias: bool = False
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Data: bytes of the Python standard library's sources
# ---------------------------------------------------------------------------------------------


def stdlib_bytes(limit: int = 64 << 20) -> torch.Tensor:
    """The ``.py`` files of this Python's standard library, concatenated, as uint8 (at most ``limit``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if total < 1 << 16:
        raise RuntimeError(f"twell bench --train: found only {total} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class Batches:
    """Training batches drawn at random offsets of the first 95% of the text, validation batches
    at fixed offsets of the rest. Every variant sees the same sequence of batches."""

    def __init__(self, text: torch.Tensor, batch: int, seq: int, device: str, seed: int, val_batches: int):
        split = int(len(text) * 0.95)
        self.train, self.val = text[:split].to(device), text[split:].to(device)
        self.batch, self.seq, self.seed = batch, seq, seed
        gen = torch.Generator().manual_seed(seed + 1)
        starts = torch.randint(0, len(self.val) - seq, (val_batches, batch), generator=gen)
        self.val_set = [self._take(self.val, s) for s in starts]

    def _take(self, data: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        # ``seq`` tokens a sequence, used as both input_ids and labels: the model shifts the labels
        # itself (position i predicts token i + 1), as every Hugging Face training script relies on.
        idx = starts.to(data.device)[:, None] + torch.arange(self.seq, device=data.device)
        return data[idx].long()

    def for_step(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self._take(self.train, torch.randint(0, len(self.train) - self.seq, (self.batch,), generator=gen))


# ---------------------------------------------------------------------------------------------
# Models and variants
# ---------------------------------------------------------------------------------------------


def build_model(cfg: TrainConfig, activation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                         num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
                         max_position_embeddings=cfg.seq, hidden_act=activation, mlp_bias=cfg.mlp_bias,
                         tie_word_embeddings=False)
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config).to(cfg.device)


@dataclass
class Variant:
    name: str
    model: torch.nn.Module
    compiled: Callable
    optimizer: torch.optim.Optimizer
    scheduler: object
    twell: bool
    losses: list = field(default_factory=list)


def twell_options(cfg: TrainConfig, name: str) -> dict:
    options: dict = {"inner": cfg.twell_inner}
    if name in ("twell", "silu-relu-gate"):
        if cfg.target_density is not None:
            options["target_density"] = cfg.target_density
        if cfg.l1_coeff is not None:
            options["l1_coeff"] = cfg.l1_coeff
        if cfg.l1_coeff_max is not None:
            options["l1_coeff_max"] = cfg.l1_coeff_max
    if name == "silu-relu-gate":
        options["relu_gate"] = True
    if cfg.compile_mode != "default":
        options["mode"] = cfg.compile_mode
    return options


def make_variant(cfg: TrainConfig, name: str, relu_base, silu_base) -> Variant:
    twell = name.startswith("twell") or name == "silu-relu-gate"
    base = silu_base if name.startswith("silu") else relu_base
    model = copy.deepcopy(base).train()
    if twell:
        compiled = torch.compile(model, backend="twell", options=twell_options(cfg, name))
    else:
        kwargs = {"mode": cfg.compile_mode} if cfg.compile_mode != "default" and cfg.baseline_backend == "inductor" else {}
        compiled = torch.compile(model, backend=cfg.baseline_backend, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, cfg.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, cfg.steps)))))
    return Variant(name, model, compiled, optimizer, scheduler, twell)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_turn(v: Variant, batches: Batches, first: int, last: int, cfg: TrainConfig) -> float:
    """Steps ``first..last-1`` back to back; returns the wall time per step in ms."""
    from .backend import uses_cuda_graphs

    mark = torch.compiler.cudagraph_mark_step_begin if uses_cuda_graphs(cfg.compile_mode) else None
    autocast = torch.autocast(cfg.device.split(":")[0], dtype=torch.bfloat16, enabled=cfg.device.startswith("cuda"))
    _sync(cfg.device)
    start = time.perf_counter()
    total = torch.zeros((), device=cfg.device)
    for step in range(first, last):
        tokens = batches.for_step(step)
        if mark is not None:
            mark()
        with autocast:
            loss = v.compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(v.model.parameters(), 1.0)
        v.optimizer.step()
        v.optimizer.zero_grad(set_to_none=True)
        v.scheduler.step()
        total += loss.detach().float()
    _sync(cfg.device)
    elapsed = time.perf_counter() - start
    v.losses.append(float(total) / max(1, last - first))
    return 1e3 * elapsed / max(1, last - first)


def measured_turn(v: Variant, batches: Batches, first: int, last: int, cfg: TrainConfig) -> tuple[float, float, float]:
    """``train_turn``'s ms a step, with the process's peak CUDA memory allocated during the turn and
    the memory reserved at its end (GiB; NaN off CUDA)."""
    if not cfg.device.startswith("cuda"):
        return train_turn(v, batches, first, last, cfg), float("nan"), float("nan")
    device = torch.device(cfg.device)
    torch.cuda.reset_peak_memory_stats(device)
    ms = train_turn(v, batches, first, last, cfg)
    return ms, torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.memory_reserved(device) / 2**30


@contextlib.contextmanager
def trained_function(v: Variant):
    """The raw model computing what the variant trains: a SiLU model under ``relu_gate`` trains
    (and is evaluated) with ReLU gates."""
    if v.name != "silu-relu-gate":
        yield v.model
        return
    saved = [layer.mlp.act_fn for layer in v.model.model.layers]
    for layer in v.model.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    try:
        yield v.model
    finally:
        for layer, act in zip(v.model.model.layers, saved):
            layer.mlp.act_fn = act


@torch.no_grad()
def val_loss(v: Variant, batches: Batches, cfg: TrainConfig) -> float:
    """Validation loss of the raw (uncompiled) model: the same function the compiled one trains,
    with no inference graph to compile."""
    autocast = torch.autocast(cfg.device.split(":")[0], dtype=torch.bfloat16, enabled=cfg.device.startswith("cuda"))
    losses = []
    with trained_function(v) as model:
        model.eval()
        for tokens in batches.val_set:
            with autocast:
                losses.append(float(model(input_ids=tokens, labels=tokens).loss))
        model.train()
    return statistics.fmean(losses)


@torch.no_grad()
def hook_densities(model, tokens: torch.Tensor, cfg: TrainConfig) -> list[float]:
    """Per layer, the share of ``act_fn(gate) · up`` entries that are not zero, on one eager forward."""
    found: list[float] = []
    handles = []
    for layer in model.model.layers:
        mlp = layer.mlp

        def hook(mod, args, out, mlp=mlp):
            x = args[0]
            h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
            found.append(float((h != 0).float().mean()))

        handles.append(mlp.register_forward_hook(hook))
    autocast = torch.autocast(cfg.device.split(":")[0], dtype=torch.bfloat16, enabled=cfg.device.startswith("cuda"))
    try:
        model.eval()
        with autocast:
            model(input_ids=tokens)
    finally:
        model.train()
        for h in handles:
            h.remove()
    return found


def observe(v: Variant, batches: Batches, cfg: TrainConfig) -> dict:
    """Density per layer, sparse layers, coefficient and dead neurons of a variant now."""
    if not v.twell:
        with trained_function(v) as model:
            per_layer = hook_densities(model, batches.val_set[0], cfg)
        return dict(per_layer=per_layer, sparse_layers=-1, paths="-", l1_coeff=float("nan"), dead=float("nan"),
                    variant="-")
    import twell_compile

    layers = twell_compile.stats(v.model).layers
    per_layer = [s.l0 / cfg.intermediate for s in layers]
    coeffs = [s.l1_coeff for s in layers if s.l1_coeff is not None]
    dead = [s.dead_neurons for s in layers if s.dead_neurons is not None]
    return dict(per_layer=per_layer, sparse_layers=sum(s.path == "sparse" for s in layers),
                paths="".join("S" if s.path == "sparse" else "D" for s in layers),
                l1_coeff=statistics.fmean(coeffs) if coeffs else float("nan"),
                dead=statistics.fmean(dead) if dead else float("nan"), variant=_graph_variant(v))


def _graph_variant(v: Variant) -> str:
    """The graph variant (variants.py) the variant's training graphs run now."""
    from . import layers, variants

    mine = layers.model_of(v.model)
    found = [c for c in variants.coordinators() if c.training and set(c.layers) & {l.id for l in mine.layers.values()}]
    if not found:
        return "twell"
    c = found[0]
    measured = "".join(f" {k} {v:.1f}ms" for k, v in sorted(c.periods.items()))
    return f"{c.current} (sparse-preferring layers {c.share_sparse():.0%}, step {c.steps}{',' if measured else ''}{measured})"


def run(cfg: TrainConfig, log: Callable[[str], None] = print, on_rows: Optional[Callable[[list], None]] = None,
        progress: bool = True) -> list[TrainRow]:
    """Train every variant for ``cfg.steps`` steps in turns; returns one row per variant and turn."""
    import twell_compile

    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"twell bench --train: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    torch._dynamo.reset()
    twell_compile.reset()
    batches = Batches(stdlib_bytes(), cfg.batch, cfg.seq, cfg.device, cfg.seed, cfg.val_batches)
    relu = build_model(cfg, "relu")
    silu = build_model(cfg, "silu") if any(v.startswith("silu") for v in cfg.variants) else None
    variants = [make_variant(cfg, name, relu, silu) for name in cfg.variants]
    del relu, silu
    baseline = cfg.variants[0]
    log(f"twell bench --train: Llama hidden {cfg.hidden}, intermediate {cfg.intermediate}, {cfg.layers} layers, "
        f"{cfg.batch}x{cfg.seq} tokens a step, {cfg.steps} steps, lr {cfg.lr:g}, compile mode {cfg.compile_mode}, "
        f"variants {', '.join(cfg.variants)} (baseline {baseline}); text: {len(batches.train):,} training bytes")
    bar = _progress(cfg.steps, progress)
    rows: list[TrainRow] = []
    for first in range(0, cfg.steps, cfg.eval_every):
        last = min(cfg.steps, first + cfg.eval_every)
        turns = {v.name: measured_turn(v, batches, first, last, cfg) for v in variants}
        for v in variants:
            seen = observe(v, batches, cfg)
            per_layer = seen["per_layer"]
            ms, peak, reserved = turns[v.name]
            rows.append(TrainRow(last, v.name, v.losses[-1], val_loss(v, batches, cfg),
                                 statistics.fmean(per_layer) if per_layer else float("nan"),
                                 ";".join(f"{d:.5f}" for d in per_layer), seen["sparse_layers"], seen["paths"],
                                 len(per_layer),
                                 seen["l1_coeff"], seen["dead"], seen["variant"], ms,
                                 turns[baseline][0] / ms, peak, reserved))
        log(format_turn(rows[-len(variants):]))
        bar(last - first)
        if on_rows is not None:
            on_rows(list(rows))
    return rows


def _progress(total: int, enabled: bool):
    if not enabled:
        return lambda n: None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return lambda n: None
    bar = tqdm(total=total, unit="step", desc="training", file=sys.stderr, leave=False)
    return bar.update


def format_turn(rows: list[TrainRow]) -> str:
    lines = [f"step {rows[0].step}:"]
    for r in rows:
        sparse = "" if r.sparse_layers < 0 else f", {r.sparse_layers}/{r.layers} layers sparse (paths {r.paths})"
        coeff = "" if math.isnan(r.l1_coeff) else f", l1 {r.l1_coeff:.3g}"
        dead = "" if math.isnan(r.dead_neurons) else f", dead {r.dead_neurons:.1%}"
        dead += "" if r.graph_variant == "-" else f", variant {r.graph_variant}"
        memory = "" if math.isnan(r.reserved_gib) else f", {r.peak_gib:.1f} GiB peak, {r.reserved_gib:.1f} reserved"
        lines.append(f"  {r.variant:<15} loss {r.train_loss:.4f}  val {r.val_loss:.4f}  density {r.density:.3%}{sparse}{coeff}{dead}"
                     f"  {r.step_ms:7.1f} ms/step ({r.ratio:.2f}x){memory}")
    return "\n".join(lines)


def summary(rows: list[TrainRow], baseline: str) -> str:
    """One line per variant: the final turn, and the step-time ratio over the last quarter of turns."""
    final = {r.variant: r for r in rows if r.step == rows[-1].step}
    base = final[baseline]
    lines = [f"{'variant':<15} {'density':>8} {'sparse layers':>13} {'val loss':>9} {'vs ' + baseline:>12} {'step ms':>8} "
             f"{'speed vs ' + baseline + ' (last quarter)':>32}"]
    for name, r in final.items():
        turns = [x for x in rows if x.variant == name]
        tail = turns[-max(1, len(turns) // 4):]
        speed = statistics.median(x.ratio for x in tail)
        sparse = "-" if r.sparse_layers < 0 else f"{r.sparse_layers}/{r.layers}"
        lines.append(f"{name:<15} {r.density:>8.3%} {sparse:>13} {r.val_loss:>9.4f} {100 * (r.val_loss / base.val_loss - 1):>+11.2f}% "
                     f"{r.step_ms:>8.1f} {speed:>31.2f}x")
    return "\n".join(lines)


def write_csv(rows: list[TrainRow], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
    return path


def write_plot(rows: list[TrainRow], path: Path, title: str) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, grid = plt.subplots(2, 3, figsize=(16, 9))
    loss, density, coeff, dead, step_ms, speed = grid.flat
    for i, name in enumerate(dict.fromkeys(r.variant for r in rows)):
        mine = [r for r in rows if r.variant == name]
        steps = [r.step for r in mine]
        style = dict(label=name, color=f"C{i}")  # one colour per variant in every panel
        loss.plot(steps, [r.val_loss for r in mine], **{**style, "label": f"{name} (val)"})
        density.plot(steps, [max(r.density, 1e-6) for r in mine], **style)
        if not all(math.isnan(r.l1_coeff) for r in mine):  # twell variants only
            coeff.plot(steps, [r.l1_coeff for r in mine], **style)
        if not all(math.isnan(r.dead_neurons) for r in mine):
            dead.plot(steps, [r.dead_neurons for r in mine], **style)
        step_ms.plot(steps, [r.step_ms for r in mine], **style)
        speed.plot(steps, [r.ratio for r in mine], **style)
    loss.set(xlabel="step", ylabel="validation loss (bytes, nats)", title="loss")
    density.set(xlabel="step", ylabel="FFN density (mean over layers)", yscale="log", title="density")
    coeff.set(xlabel="step", ylabel="L1 coefficient (mean over layers)", yscale="log", title="coefficient")
    dead.set(xlabel="step", ylabel="dead neurons (mean share over layers)", title="dead neurons")
    dead.set_ylim(bottom=0)
    step_ms.set(xlabel="step", ylabel="ms a step (turn mean, host time included)", yscale="log",
                title="step time (the first turn compiles)")
    speed.set(xlabel="step", ylabel=f"speed vs {rows[0].variant} (step-time ratio)", title="speed")
    speed.axhline(1.0, color="grey", lw=0.8)
    for ax in grid.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    from .options import COMPILE_MODES

    p = argparse.ArgumentParser(prog="twell bench --train", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32, help="sequences a step (default 32)")
    p.add_argument("--seq", type=int, default=512, help="tokens a sequence (default 512)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--l1", type=float, default=None, dest="l1_coeff", help="twell's fixed L1 coefficient")
    p.add_argument("--target-density", type=float, default=None, help="twell steers its coefficient to this density")
    p.add_argument("--l1-max", type=float, default=None, dest="l1_coeff_max", help="the steered coefficient's ceiling")
    p.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    p.add_argument("--eval-every", type=int, default=50, help="steps a turn: each variant runs them back to back")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=["inductor", "twell"], choices=VARIANTS,
                   help="the first is the baseline of the speed ratios (default: inductor twell)")
    p.add_argument("--baseline-backend", default="inductor", help=argparse.SUPPRESS)
    p.add_argument("--twell-inner", default="inductor", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mlp-bias", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    return p


def replay_line() -> str:
    """How many CUDA graphs the TwELL ops recorded of their own calls in this run, how many are
    kept at its end and the memory they reserved (docs/architecture.md, "Replayed calls")."""
    from .lowering import replay_stats

    recorded, kept, held, outcomes = replay_stats()
    line = (f"replayed calls: {recorded} CUDA graphs recorded in this run, {kept} kept at its end, "
            f"holding {held / 2**20:.0f} MB (reserved while recording)")
    return "; ".join([line, *outcome_parts(outcomes)])


def outcome_parts(outcomes: dict) -> list[str]:
    """``replay_stats``' outcomes in words: per direction, the calls replayed and the eager ones by
    reason; then the training forwards run from graphs (each meets a backward: fewer backward
    calls mean some did not find their forward graph), the layers whose graphs copy the weights in,
    the keys dropped and evicted, and the failed captures."""
    parts = []
    for direction in ("forward", "backward"):
        eager, reasons = eager_reasons(outcomes, direction)
        if not eager and f"{direction} replayed" not in outcomes:
            continue
        parts.append(f"{direction} calls: {outcomes.get(f'{direction} replayed', 0)} replayed, {eager} eager"
                     + (f" ({reasons})" if reasons else ""))
    parts += [f"{name} {n}" for name, n in sorted(outcomes.items())
              if "keys" in name or "failed" in name or name.startswith(("training forwards", "layers whose"))]
    return parts


def main(argv: Optional[list[str]] = None, host_line: Optional[Callable[[int, int], str]] = None) -> int:
    """``twell bench --train``; ``host_line(D, H)`` (``bench.host_line``, passed by ``twell bench``)
    adds the TwELL ops' host time at this model's FFN shape to the summary on a GPU."""
    args = build_parser().parse_args(argv)
    values = vars(args)
    out, progress = values.pop("out"), not values.pop("no_progress")
    values.pop("train")
    values["variants"] = tuple(values["variants"])
    cfg = TrainConfig(**values)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        print("twell bench --train: no CUDA device; pass --device cpu for a (slow) CPU run", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    title = (f"Llama {cfg.hidden}/{cfg.intermediate}/{cfg.layers} layers, {cfg.batch}x{cfg.seq} tokens, "
             f"compile mode {cfg.compile_mode}")
    rows = run(cfg, on_rows=lambda rows: write_csv(rows, out / "train.csv"), progress=progress)
    print(summary(rows, cfg.variants[0]))
    print(replay_line())
    if host_line is not None and cfg.device.startswith("cuda"):
        print(host_line(cfg.hidden, cfg.intermediate))
    write_csv(rows, out / "train.csv")
    plot = write_plot(rows, out / "train.png", title)
    print(f"wrote {out / 'train.csv'}" + (f" and {plot}" if plot else ""))
    return 0
