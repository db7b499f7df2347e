"""200 training steps of a small Llama with ``backend="twell"`` against the same loop on the
reference path (GPU only, ``-m gpu``).

The reference path is eager PyTorch with the L1 term written out: ``loss + l1_coeff · mean over
layers of (1/T) Σ|h|``, ``h`` taken as each down projection's input (docs/architecture.md, 'The L1 regularizer'). Both
loops start from the same weights and see the same batches (bytes of a stdlib source file), with
AdamW. twell runs twice: as dispatched (each layer starts dense and turns sparse as L1 works) and
with the Triton sparse path forced on from the first step, so the sparse forward and backward
kernels carry the whole run.

Pass: the loss curves track each other (mean absolute gap over the last 50 steps, and the final
smoothed loss, within a few per cent of the loss), the loss falls, and L1 makes the FFNs sparse.
fp32 weights keep the comparison about the kernels rather than bf16 rounding chaos.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import statistics

import pytest
import torch

import twell_compile

from tests.ffn_models import eager_loss, reset_state

pytestmark = pytest.mark.gpu
import transformers

STEPS, BATCH, SEQ, L1 = 200, 8, 128, 5e-3
# The GPU is the point; on CPU (the reference kernels) it still runs, by hand, to debug the test.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_act="relu", hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=256, mlp_bias=True,
        max_position_embeddings=SEQ, attention_dropout=0.0,
    )
    return transformers.LlamaForCausalLM(cfg).to(DEVICE)


def _batches():
    data = torch.tensor(list(inspect.getsource(inspect).encode()), dtype=torch.long)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        starts = torch.randint(0, data.numel() - SEQ, (BATCH,), generator=gen)
        yield torch.stack([data[s:s + SEQ] for s in starts]).to(DEVICE)


def _train(model, step_loss):
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []  # the language-model loss (without the L1 term)
    for tokens in _batches():
        loss, lm_loss = step_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(lm_loss.item())
    return losses


def _reference_loss(model, tokens):
    """``(loss + L1 term, loss)``, eagerly."""
    downs = [layer.mlp.down_proj for layer in model.model.layers]
    lm = []
    total = eager_loss(model, lambda: model(tokens, labels=tokens), lambda o: lm.append(o.loss) or o.loss, L1,
                       modules=downs, hidden_fn=lambda m, h: h)
    return total, lm[0]


def _twell_loss(compiled):
    """twell adds the L1 term's gradient in backward: the loss itself is the language-model loss."""
    def step(model, tokens):
        loss = compiled(tokens, labels=tokens).loss
        return loss, loss
    return step


def _smooth(xs, n=20):
    return statistics.fmean(xs[-n:])


@pytest.mark.parametrize("path", ["dispatched", "sparse"])
def test_loss_curve_tracks_the_reference_path(path):
    from twell_compile.lowering import force_path

    reset_state()
    base = _model()
    ref_model = copy.deepcopy(base)
    ref = _train(ref_model, _reference_loss)

    model = copy.deepcopy(base)
    # "sparse" forces the ops' path, so it compiles the TwELL variant alone (variants.py).
    compiled = torch.compile(model, backend="twell", options={"l1_coeff": L1, "dense_variant": path != "sparse"})
    try:
        with force_path("sparse") if path == "sparse" else contextlib.nullcontext():
            ours = _train(model, _twell_loss(compiled))
            stats = twell_compile.stats()
    finally:
        reset_state()

    print(f"\n{path}: reference loss {ref[0]:.3f} -> {_smooth(ref):.3f}, twell {ours[0]:.3f} -> {_smooth(ours):.3f}")
    print(stats)
    assert abs(ours[0] - ref[0]) < 1e-3 * abs(ref[0])  # same weights, same batch: same first loss
    assert _smooth(ref) < 0.6 * ref[0]  # the loop learns
    gap = statistics.fmean(abs(a - b) for a, b in zip(ours[-50:], ref[-50:]))
    assert gap < 0.05 * _smooth(ref), f"mean |loss gap| over the last 50 steps {gap:.4f}"
    assert abs(_smooth(ours) - _smooth(ref)) < 0.03 * _smooth(ref)
    assert len(stats.layers) == 4 and all(s.calls >= STEPS for s in stats.layers)
    assert all(s.l0 < 0.25 * 512 for s in stats.layers), "L1 did not sparsify the FFNs"  # ~256 at init
    if path == "sparse":
        assert all(s.path == "sparse" for s in stats.layers)
