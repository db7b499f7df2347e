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
gradient is injected where h is back-propagated (DESIGN.md section 4).
"""

from __future__ import annotations

import math
import random
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import twell_compile

# Defaults chosen by timing on a 2-core CPU machine (torch 2.13, aot_eager inner): see
# ``DemoConfig`` below and the numbers in ``docs/usage.md``.
DEFAULT_STEPS = 60
DEFAULT_L1 = 3e-2


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
    batch: int = 16
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


def run(cfg: DemoConfig, *, echo: Callable[[str], None] = print, inner_why: str = "", progress: bool = True) -> History:
    """Build, compile with ``backend="twell"``, train ``cfg.steps`` steps; prints as it goes."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    twell_compile.reset()
    twell_compile.set_l1_coeff(0.0)

    corpus, n_files = load_corpus()
    model, model_desc = build_model(cfg)
    model.to(cfg.device).train()
    n_params = sum(p.numel() for p in model.parameters())
    ffn_params = sum(p.numel() for n, p in model.named_parameters() if "mlp" in n)

    echo(f"twell demo: train a small ReLU language model with torch.compile(backend=\"twell\")")
    echo("")
    echo(f"  model    {model_desc}")
    echo(f"           {cfg.layers} layers, hidden {cfg.hidden}, FFN {cfg.intermediate} (gated ReLU), {cfg.heads} heads, {n_params / 1e6:.2f}M parameters ({ffn_params / n_params:.0%} in FFNs)")
    echo(f"  data     {corpus.numel() / 1e6:.1f} MB of Python's standard library ({n_files} files), byte tokens (vocab 256)")
    echo(f"           batches of {cfg.batch} random windows of {cfg.seq_len} bytes = {cfg.batch * cfg.seq_len} tokens/step, seed {cfg.seed}")
    echo(f"  device   {_device_name(cfg.device)}")
    echo(f"  inner    {cfg.inner}" + (f" ({inner_why})" if inner_why else ""))
    echo(f"  L1       coefficient {cfg.l1:g}, ramped linearly from 0 over the first {cfg.warmup} steps with twell_compile.set_l1_coeff (no recompile)")
    echo(f"           (the paper uses 2e-5 over billions of tokens; a demo of {cfg.steps} steps needs a stronger push)")
    echo("")

    compiled = torch.compile(model, backend="twell", options={"l1_coeff": 0.0, "inner": cfg.inner})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    data = batches(corpus, cfg.batch, cfg.seq_len, cfg.seed, cfg.device)
    hist = History()

    def step(i: int) -> None:
        coeff = cfg.l1_at(i)
        twell_compile.set_l1_coeff(coeff)
        x, y = next(data)
        logits = _logits(compiled, x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        s = twell_compile.stats()
        hist.step.append(i)
        hist.loss.append(loss.item())
        hist.l0.append(s.l0 if s.l0 is not None else float("nan"))
        hist.l1.append(s.l1 if s.l1 is not None else float("nan"))
        hist.coeff.append(coeff)
        hist.dense_rows.append(sum(l.dense_rows for l in s.layers) / max(1, sum(l.tokens for l in s.layers)))

    echo("compiling (the first step traces the model, rewrites its FFNs and compiles the graph) ...")
    t0 = time.perf_counter()
    step(1)
    t_compile = time.perf_counter() - t0
    rep = twell_compile.report()
    graphs_after_compile = rep.graphs
    echo(f"first step done in {t_compile:.1f} s\n")
    echo(_indent(str(rep)))
    echo("")
    echo(f"step 1: loss {hist.loss[0]:.3f}, L0 {hist.l0[0]:.1f} of {cfg.intermediate} neurons active per token ({hist.l0[0] / cfg.intermediate:.0%})")
    echo("")

    t_train = time.perf_counter()
    bar = tqdm(range(2, cfg.steps + 1), desc="training", unit="step", disable=not progress, dynamic_ncols=True, leave=True)
    for i in bar:
        step(i)
        bar.set_postfix_str(f"loss {hist.loss[-1]:.3f}  L0 {hist.l0[-1]:.1f}  L1 {hist.l1[-1]:.3g}  coeff {hist.coeff[-1]:.2g}")
    bar.close()
    t_train = time.perf_counter() - t_train

    echo("")
    echo(_indent(_summary_table(hist, cfg)))
    echo("")
    recompiles = twell_compile.report().graphs - graphs_after_compile
    first, last = hist.l0[0], hist.l0[-1]
    echo(
        f"L0 fell from {first:.1f} to {last:.1f} active neurons per token ({first / cfg.intermediate:.0%} → {last / cfg.intermediate:.1%} of {cfg.intermediate}), "
        f"while the loss went from {hist.loss[0]:.2f} to {hist.loss[-1]:.2f} ({hist.loss[-1] / math.log(2):.2f} bits/byte)."
    )
    echo(
        f"The coefficient changed {len(set(hist.coeff))} times through set_l1_coeff; graphs compiled after step 1: {recompiles}."
    )
    echo("")
    echo(_indent("per-layer telemetry of the last step (twell_compile.stats()):\n" + str(twell_compile.stats())))
    echo("")
    total = time.perf_counter() - t_start
    per_step = t_train / max(1, cfg.steps - 1)
    echo(f"time: {total:.1f} s in all; first step (compile) {t_compile:.1f} s, then {per_step * 1000:.0f} ms/step")
    return hist


def _summary_table(hist: History, cfg: DemoConfig) -> str:
    n = len(hist.step)
    picks = sorted({0, *(round(k * (n - 1) / 6) for k in range(1, 7))})
    rows = []
    for k in picks:
        rows.append(
            [
                str(hist.step[k]),
                f"{hist.coeff[k]:.3g}",
                f"{hist.loss[k]:.3f}",
                f"{hist.l0[k]:.1f}",
                f"{hist.l0[k] / cfg.intermediate:.1%}",
                f"{hist.l1[k]:.3g}",
                f"{hist.dense_rows[k]:.0%}",
                _bar(hist.l0[k] / cfg.intermediate),
            ]
        )
    header = ["step", "L1 coeff", "loss", "L0", "active", "L1", "dense rows", "density"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" if i < len(header) - 1 else f"{{:<{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])


def _bar(frac: float, width: int = 20) -> str:
    if frac != frac:
        return ""
    full = frac * width
    blocks = " ▏▎▍▌▋▊▉█"
    n = int(full)
    rest = int((full - n) * 8)
    return "█" * n + (blocks[rest] if n < width and rest else "")


def _indent(text: str, pad: str = "  ") -> str:
    return "\n".join(pad + line if line else line for line in text.splitlines())


def _device_name(device: str) -> str:
    if device == "cuda":
        return f"cuda ({torch.cuda.get_device_name()})"
    return f"cpu ({torch.get_num_threads()} threads)"


def plot(hist: History, path: str) -> None:
    """Loss, L0 and L1 against the step, as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, values, title in zip(axes, (hist.loss, hist.l0, hist.l1), ("cross-entropy loss", "L0: active FFN neurons per token", "L1: (1/T) Σ|h| per layer")):
        ax.plot(hist.step, values)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle('twell demo: torch.compile(backend="twell") with the injected L1')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
