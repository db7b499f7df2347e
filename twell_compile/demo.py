"""``twell demo``: train a small ReLU language model with ``backend="twell"`` and watch it sparsify.

What it shows, top to bottom:

1. a small Llama-style model with gated ReLU FFNs (Hugging Face ``LlamaForCausalLM`` with
   ``hidden_act="relu"`` when transformers is installed, else the short decoder below);
2. ``torch.compile(model, backend="twell", options={"l1_coeff": ..., "inner": ...})`` and the rewrite
   report (``twell_compile.report()``) after the first step compiled the graph;
3. a few dozen AdamW steps on bytes of Python's own standard library (ships with every Python, so
   the demo runs offline); the L1 coefficient warms up through ``twell_compile.set_l1_coeff``,
   which changes the live 0-d coefficient tensors and never recompiles;
4. L0 (active FFN neurons per token) and L1 (``(1/T) Σ|h|``) falling as the injected L1 gradient
   works, from ``twell_compile.stats()``.

The loss printed is the model's cross-entropy only: the L1 term is never added to the loss, its
gradient is injected where h is back-propagated (docs/architecture.md, 'The L1 regularizer').
"""

from __future__ import annotations

import functools
import math
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import twell_compile

# Defaults chosen by timing on a 2-core CPU machine shared with other jobs (torch 2.13, aot_eager
# inner, one thread): 60 steps of 1,024 tokens took 30-35 s with the compile, and 5e-3 took L0 from
# 50% to about 1% of the 512 neurons while the loss kept falling. 3e-2, tried first, drove L0 below
# one neuron per token within 30 steps; 3e-3 ended near 3%.
DEFAULT_STEPS = 60
DEFAULT_L1 = 5e-3

# ``twell demo --tiny``: a smoke-test size (seconds), not meant to show anything.
TINY = dict(steps=5, hidden=64, intermediate=256, heads=2, seq_len=32, batch=4)


@dataclass(frozen=True)
class DemoConfig:
    """Everything ``twell demo`` needs; ``cli.py`` validates the user's values before building it.

    Args:
        steps: training steps (AdamW), the first of which compiles.
        device: ``"cpu"`` or ``"cuda"`` (``"auto"`` is resolved by the CLI).
        inner: the twell backend's inner compiler (``"inductor"``, ``"aot_eager"``, ``"eager"``).
        l1: the final L1 coefficient, reached after ``warmup`` steps of a linear ramp from 0.
        seed: seeds the weights and the batch sampler.
        model: ``"auto"`` (Hugging Face Llama if transformers imports, else built-in),
            ``"llama"`` or ``"builtin"``.
    """

    steps: int = DEFAULT_STEPS
    device: str = "cpu"
    inner: str = "aot_eager"
    l1: float = DEFAULT_L1
    seed: int = 0
    model: str = "auto"
    # model and data sizes: small enough for a 2-core CPU, large enough for the FFN to matter
    vocab: int = 256  # byte-level tokens
    hidden: int = 128
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    seq_len: int = 128
    batch: int = 8
    lr: float = 3e-3
    warmup_frac: float = 0.2  # fraction of the steps over which the L1 coefficient ramps up

    @property
    def warmup(self) -> int:
        return max(1, round(self.steps * self.warmup_frac))

    def l1_at(self, step: int) -> float:
        """The L1 coefficient for ``step`` (1-based): linear ramp from 0 to ``l1`` over ``warmup`` steps."""
        return self.l1 * min(1.0, (step - 1) / self.warmup)


@dataclass
class History:
    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    l0: list[float] = field(default_factory=list)
    l1: list[float] = field(default_factory=list)
    coeff: list[float] = field(default_factory=list)
    dense_rows: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Data: bytes of the standard library
# ---------------------------------------------------------------------------------------------


def load_corpus() -> tuple[torch.Tensor, int]:
    """All top-level ``*.py`` files of this Python's standard library, concatenated, as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    data = b"\n".join(f.read_bytes() for f in files)
    if len(data) < 1 << 16:  # a stripped-down Python: fall back to this package's own sources
        files = sorted(Path(__file__).parent.rglob("*.py"))
        data = b"\n".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), len(files)


def batches(corpus: torch.Tensor, batch: int, seq_len: int, seed: int, device: str):
    """Random windows of ``seq_len + 1`` bytes: (inputs, next-byte targets), each ``[batch, seq_len]``."""
    g = torch.Generator().manual_seed(seed)
    n = corpus.numel() - seq_len - 1
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, n, (batch, 1), generator=g)
        window = corpus[starts + offsets].long()  # [batch, seq_len + 1]
        yield window[:, :-1].to(device), window[:, 1:].to(device)


# ---------------------------------------------------------------------------------------------
# Model: Hugging Face Llama with ReLU, or a short built-in decoder of the same shape
# ---------------------------------------------------------------------------------------------


def build_model(cfg: DemoConfig) -> tuple[nn.Module, str]:
    """The model and a one-line description of it."""
    if cfg.model in ("auto", "llama"):
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            if cfg.model == "llama":
                raise
        else:
            config = LlamaConfig(
                vocab_size=cfg.vocab,
                hidden_size=cfg.hidden,
                intermediate_size=cfg.intermediate,
                num_hidden_layers=cfg.layers,
                num_attention_heads=cfg.heads,
                num_key_value_heads=cfg.heads,
                max_position_embeddings=cfg.seq_len,
                hidden_act="relu",
                tie_word_embeddings=True,
                attn_implementation="sdpa",
            )
            return LlamaForCausalLM(config), "transformers.LlamaForCausalLM (hidden_act='relu')"
    return TinyDecoder(cfg), "built-in decoder (transformers not installed)" if cfg.model == "auto" else "built-in decoder"


class GatedReluMLP(nn.Module):
    """``down(relu(gate(x)) * up(x))``: the FFN the twell backend rewrites."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.RMSNorm(cfg.hidden), nn.RMSNorm(cfg.hidden)
        self.qkv, self.proj = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False), nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.mlp = GatedReluMLP(cfg.hidden, cfg.intermediate)

    def forward(self, x):  # x: [B, T, D]
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)  # each [B, nh, T, hs]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hs]
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    """A minimal pre-norm decoder (learned positions) for machines without transformers."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.embed, self.pos = nn.Embedding(cfg.vocab, cfg.hidden), nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        for m in self.modules():  # Llama's initializer_range: N(0, 0.02) for every weight matrix
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids):  # [B, T] → logits [B, T, V]
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T


def _logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids)
    return out.logits if hasattr(out, "logits") else out


# ---------------------------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------------------------


def run(
    cfg: DemoConfig,
    *,
    echo: Callable[[str], None] = functools.partial(print, flush=True),
    inner_why: str = "",
    device_why: str = "",
    progress: bool = True,
) -> History:
    """Build, compile with ``backend="twell"``, train ``cfg.steps`` steps; prints as it goes."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    twell_compile.reset()

    corpus, n_files = load_corpus()
    model, model_desc = build_model(cfg)
    model.to(cfg.device).train()
    n_params = sum(p.numel() for p in model.parameters())
    ffn_params = sum(p.numel() for n, p in model.named_parameters() if "mlp" in n)
    tokens = cfg.batch * cfg.seq_len

    echo('twell demo: torch.compile(model, backend="twell") on a small ReLU language model')
    echo("")
    echo(f"  model   {model_desc}")
    echo(f"          {cfg.layers} layers, hidden {cfg.hidden}, FFN {cfg.intermediate} (gated ReLU), {cfg.heads} heads: {n_params / 1e6:.2f}M parameters, {ffn_params / n_params:.0%} in the FFNs")
    echo(f"  data    {corpus.numel() / 1e6:.1f} MB of Python's own standard library ({n_files} files), one token per byte")
    echo(f"          {cfg.batch} random windows of {cfg.seq_len} bytes per step = {tokens:,} tokens, seed {cfg.seed}")
    echo(f"  device  {_device_name(cfg.device)}" + (f" ({device_why})" if device_why else ""))
    echo(f"  inner   {cfg.inner}" + (f" ({inner_why})" if inner_why else ""))
    echo(f"  L1      coefficient {cfg.l1:g}, ramped up from 0 over steps 1-{cfg.warmup + 1} with twell_compile.set_l1_coeff (no recompile)")
    echo(f"          (the paper uses 2e-5 over billions of tokens; {cfg.steps} steps need a harder push)")
    echo("")

    compiled = torch.compile(model, backend="twell", options={"l1_coeff": cfg.l1_at(1), "inner": cfg.inner})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    data = batches(corpus, cfg.batch, cfg.seq_len, cfg.seed, cfg.device)
    hist = History()

    def step(i: int) -> None:
        coeff = cfg.l1_at(i)
        twell_compile.set_l1_coeff(coeff)  # writes the live 0-d coefficient tensors in place
        x, y = next(data)
        logits = _logits(compiled, x)  # [B, T, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))  # CE only: the L1 is injected in backward
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        s = twell_compile.stats()  # reads the layers' device counters (a sync; fine in a demo)
        hist.step.append(i)
        hist.loss.append(loss.item())
        hist.l0.append(s.l0 if s.l0 is not None else float("nan"))
        hist.l1.append(s.l1 if s.l1 is not None else float("nan"))
        hist.coeff.append(coeff)
        hist.dense_rows.append(sum(layer.dense_rows for layer in s.layers) / max(1, sum(layer.tokens for layer in s.layers)))

    t_setup = time.perf_counter() - t_start
    echo("step 1 traces the model, rewrites its FFNs and compiles the graph ...")
    t0 = time.perf_counter()
    step(1)
    t_compile = time.perf_counter() - t0
    rep = twell_compile.report()
    graphs_after_compile = rep.graphs
    echo(f"... done in {t_compile:.1f} s. twell_compile.report():")
    echo("")
    echo(_indent(str(rep)))
    echo("")
    if not rep.rewritten:
        echo("no FFN was rewritten, so there is nothing to sparsify; stopping here.")
        return hist
    echo(f"step 1: loss {hist.loss[0]:.3f}, {hist.l0[0]:.1f} of {cfg.intermediate} FFN neurons active per token ({hist.l0[0] / cfg.intermediate:.0%})")
    echo("")

    t_train = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=1, desc="training", unit="step", disable=not progress, dynamic_ncols=True, leave=True)
    for i in range(2, cfg.steps + 1):
        step(i)
        bar.set_postfix_str(f"loss {hist.loss[-1]:.3f}  L0 {hist.l0[-1]:.1f}  L1 {hist.l1[-1]:.3g}", refresh=False)
        bar.update(1)
    bar.close()
    t_train = time.perf_counter() - t_train

    window = max(1, cfg.steps // 12)
    echo("")
    echo("  L0 = active FFN neurons per token, L1 = (1/T) Σ|h| per layer, both from twell_compile.stats();")
    echo(f"  dense rows = tokens the op computed densely (a tile overflowed). Means over the {window} steps up to each row." if window > 1 else "  dense rows = tokens the op computed densely (a tile overflowed).")
    echo("")
    echo(_indent(_summary_table(hist, cfg, window), "  "))
    echo("")
    recompiles = twell_compile.report().graphs - graphs_after_compile
    n = min(window, len(hist.l0))
    first, last = hist.l0[0], _mean(hist.l0[-n:])
    loss_last = _mean(hist.loss[-n:])
    verb = "fell" if last < first else "went"
    echo(
        f"L0 {verb} from {first:.0f} to {last:.1f} active neurons per token ({first / cfg.intermediate:.0%} → {last / cfg.intermediate:.1%} of {cfg.intermediate}) "
        f"while the loss {'fell' if loss_last < hist.loss[0] else 'went'} from {hist.loss[0]:.2f} to {loss_last:.2f} ({loss_last / math.log(2):.2f} bits per byte)."
    )
    if max(hist.l1[: cfg.warmup + 1]) > hist.l1[0] * 1.2:
        echo("(L1 rises at first: the activations grow as the model starts to learn, while the coefficient is still small.)")
    echo(f"set_l1_coeff changed the coefficient {len(set(hist.coeff)) - 1} times; graphs compiled after step 1: {recompiles}.")
    echo("")
    echo("twell_compile.stats() after the last step:")
    echo(_indent(str(twell_compile.stats())))
    echo("")
    t_infer = time.perf_counter()
    _show_inference(model, compiled, next(data)[0], echo)
    t_infer = time.perf_counter() - t_infer
    total = time.perf_counter() - t_start
    more = cfg.steps - 1
    echo(
        f"time: {total:.0f} s in all: setup (data, model) {t_setup:.1f} s, step 1 with the compile {t_compile:.1f} s, "
        f"{more} more step{'s' if more != 1 else ''} {t_train:.1f} s ({t_train / max(1, more):.2f} s each), inference check {t_infer:.1f} s"
    )
    return hist


@torch.no_grad()
def _show_inference(model: nn.Module, compiled: nn.Module, x: torch.Tensor, echo: Callable[[str], None]) -> None:
    """Run a fresh batch through the compiled model under ``no_grad`` and through the plain model.

    Without grad Dynamo traces a second graph, in which the matcher picks the inference op
    ``twell::ffn``; the uncompiled ``model`` (same parameters) is the dense reference.
    """
    before = len(twell_compile.report().rewritten)
    t0 = time.perf_counter()
    sparse = _logits(compiled, x).float()
    seconds = time.perf_counter() - t0
    dense = _logits(model, x).float()
    new = twell_compile.report().rewritten[before:]
    ops = ", ".join(sorted({r.op for r in new})) or "the ops of the graph compiled before"
    rel = (torch.linalg.vector_norm(sparse - dense) / torch.linalg.vector_norm(dense)).item()
    ids = {r.layer for r in new}
    l0 = _mean([s.l0 for s in twell_compile.stats().layers if s.layer in ids])
    echo(f"inference: under torch.no_grad() the model compiled once more ({seconds:.1f} s); its {len(new)} FFNs run {ops}.")
    if ids:
        echo(f"On a fresh batch {l0:.1f} neurons per token are active, and the logits match the uncompiled dense model")
    else:
        echo("On a fresh batch the logits match the uncompiled dense model")
    echo(f"to a relative error of {rel:.1e}: the same function, with overflowing rows computed densely, never dropped.")
    echo("")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _summary_table(hist: History, cfg: DemoConfig, window: int) -> str:
    """About seven rows from step 1 to the last step; each row averages ``window`` steps up to it."""
    n = len(hist.step)
    picks = sorted({0, *(round(k * (n - 1) / 6) for k in range(1, 7))})
    rows = []
    for k in picks:
        lo = 0 if k == 0 else max(1, k - window + 1)  # step 1 (dense, before any L1) stands alone
        sl = slice(lo, k + 1)
        l0 = _mean(hist.l0[sl])
        rows.append(
            [
                str(hist.step[k]),
                f"{hist.coeff[k]:.2g}",
                f"{_mean(hist.loss[sl]):.3f}",
                f"{l0:.1f}",
                f"{l0 / cfg.intermediate:.1%}",
                f"{_mean(hist.l1[sl]):.3g}",
                f"{_mean(hist.dense_rows[sl]):.0%}",
                _bar(l0 / cfg.intermediate / 0.5),
            ]
        )
    header = ["step", "L1 coeff", "loss", "L0", "active", "L1", "dense rows", "active (full bar = 50%)"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" if i < len(header) - 1 else f"{{:<{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])


def _bar(frac: float, width: int = 20) -> str:
    if frac != frac:
        return ""
    full = min(frac, 1.0) * width
    blocks = " ▏▎▍▌▋▊▉█"
    n = int(full)
    rest = int((full - n) * 8)
    return "█" * n + (blocks[rest] if n < width and rest else "")


def _indent(text: str, pad: str = "  ") -> str:
    return "\n".join(pad + line if line else line for line in text.splitlines())


def _device_name(device: str) -> str:
    if device == "cuda":
        return f"cuda ({torch.cuda.get_device_name()})"
    n = torch.get_num_threads()
    return f"cpu, {n} thread{'s' if n > 1 else ''}"


def plot(hist: History, path: str) -> None:
    """Loss, L0 and L1 against the step, as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = (
        (hist.loss, "cross-entropy loss", "linear"),
        (hist.l0, "L0: active FFN neurons per token", "log"),
        (hist.l1, "L1: (1/T) Σ|h|, mean over layers", "log"),
    )
    for ax, (values, title, scale) in zip(axes, panels):
        ax.plot(hist.step, values)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_yscale(scale)
        if scale == "log":  # ticks at 1, 2, 5 × 10^k, printed as plain numbers
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
    coeff = axes[2].twinx()  # the warm-up of set_l1_coeff, on the L1 panel
    coeff.plot(hist.step, hist.coeff, color="gray", linestyle="--", linewidth=1)
    coeff.set_ylabel("L1 coefficient (dashed)", color="gray")
    coeff.tick_params(axis="y", colors="gray")
    fig.suptitle('twell demo: torch.compile(backend="twell") with the injected L1')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
