"""Hugging Face models built from tiny configs (no downloads), compiled with ``backend="twell"``.

* ``LlamaForCausalLM`` with ``hidden_act="relu"``: gated FFNs, with and without ``mlp_bias``;
* ``OPTForCausalLM`` with ``activation_function="relu"``: plain FFNs (``fc1`` / ``fc2`` are
  ``nn.Linear``);
* ``GPT2LMHeadModel``: its MLP uses ``Conv1D`` (``addmm`` with the weight in ``[in, out]`` layout),
  which the matcher does not accept, so nothing is rewritten and the logits are unchanged.

Inference logits must equal eager; training gradients must equal eager autograd of
``loss + l1_coeff · mean_layers (1/T) Σ|h|`` (docs/architecture.md, 'The L1 regularizer'), with ``h`` taken as the input
of each down projection.
"""

from __future__ import annotations

import copy

import pytest
import torch

import twell_compile

from tests.ffn_models import assert_close, assert_grads_close, eager_loss, reset_state

import transformers

VOCAB, LAYERS = 128, 2


@pytest.fixture(autouse=True)
def _fresh():
    reset_state()
    yield
    reset_state()


def llama(mlp_bias: bool):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_act="relu", hidden_size=64, intermediate_size=200, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB, mlp_bias=mlp_bias,
        max_position_embeddings=64, attention_dropout=0.0,
    )
    model = transformers.LlamaForCausalLM(cfg)
    downs = [layer.mlp.down_proj for layer in model.model.layers]
    return model, downs


def opt():
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(
        activation_function="relu", hidden_size=64, ffn_dim=200, num_hidden_layers=LAYERS,
        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    model = transformers.OPTForCausalLM(cfg)
    downs = [layer.fc2 for layer in model.model.decoder.layers]
    return model, downs


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        activation_function="relu", n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
    )
    return transformers.GPT2LMHeadModel(cfg), []


MODELS = {"llama": lambda: llama(False), "llama-mlp_bias": lambda: llama(True), "opt": opt}


def ids(batch=2, seq=12, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def compile_twell(model, **options):
    options.setdefault("inner", "aot_eager")
    return torch.compile(model, backend="twell", options=options)


@pytest.mark.parametrize("name", list(MODELS))
def test_inference_logits_match_eager(name):
    model, _ = MODELS[name]()
    model.eval()
    tokens = ids()
    with torch.no_grad():
        got = compile_twell(model)(tokens).logits
        want = model(tokens).logits
    assert_close(got, want, rtol=1e-4, atol=1e-5, name="logits")
    report = twell_compile.report()
    assert len(report.rewritten) == LAYERS, str(report)  # exactly one rewrite per layer
    assert all(r.op == "twell::ffn" for r in report.rewritten), str(report)
    kind = "plain" if name == "opt" else "gated"
    biases = {"llama": "none", "llama-mlp_bias": "gate,up,down", "opt": "up,down"}[name]
    assert all(r.kind == kind and r.biases == biases and r.dtype == "float32" for r in report.rewritten), str(report)


@pytest.mark.parametrize("name", list(MODELS))
def test_training_gradients_match_eager_with_l1(name):
    l1 = 0.05
    model, _ = MODELS[name]()
    ref, ref_downs = MODELS[name]()
    model.train()
    ref.train()
    tokens = ids()
    out = compile_twell(model, l1_coeff=l1)(tokens, labels=tokens)
    out.loss.backward()
    report = twell_compile.report()
    assert len(report.rewritten) == LAYERS and all(r.op == "twell::ffn_train" for r in report.rewritten), str(report)

    loss = eager_loss(ref, lambda: ref(tokens, labels=tokens), lambda o: o.loss, l1, modules=ref_downs, hidden_fn=lambda m, h: h)
    loss.backward()
    assert_close(out.loss, ref(tokens, labels=tokens).loss, rtol=1e-5, atol=1e-6, name="loss")
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)

    stats = twell_compile.stats()
    assert len(stats.layers) == LAYERS and all(s.tokens == tokens.numel() for s in stats.layers)


def test_llama_report_names_module_paths():
    """``where`` is the FFN's module path, usable with ``get_submodule`` (HF wraps ``forward``)."""
    model, _ = llama(False)
    model.eval()
    with torch.no_grad():
        compile_twell(model, inner="eager")(ids())
    wheres = [r.where for r in twell_compile.report().rewritten]
    assert wheres == [f"model.layers.{i}.mlp" for i in range(LAYERS)], wheres
    for where in wheres:
        assert isinstance(model.get_submodule(where), transformers.models.llama.modeling_llama.LlamaMLP)


def test_opt_report_names_decoder_layers():
    model, _ = opt()
    model.eval()
    with torch.no_grad():
        compile_twell(model, inner="eager")(ids())
    wheres = [r.where for r in twell_compile.report().rewritten]
    assert wheres == [f"model.decoder.layers.{i}" for i in range(LAYERS)], wheres


def test_gpt2_conv1d_mlp_is_left_alone():
    """GPT-2's Conv1D MLP (``addmm(b, x, W)`` with ``W [in, out]``) is not in nn.Linear layout."""
    model, _ = gpt2()
    model.eval()
    tokens = ids()
    with torch.no_grad():
        got = compile_twell(model)(tokens).logits
        want = model(tokens).logits
    assert_close(got, want, rtol=1e-5, atol=1e-6, name="logits")
    report = twell_compile.report()
    assert report.rewritten == [], str(report)
    assert all(s.reason is not None for s in report.skipped)


def test_llama_patch_matches_eager_and_rewrites_each_mlp():
    """``twell_compile.patch`` on a Hugging Face model: every LlamaMLP is one op."""
    model, _ = llama(True)
    ref = copy.deepcopy(model)
    model.eval()
    ref.eval()
    result = twell_compile.patch(model)
    assert [r.where for r in result.rewritten] == [f"model.layers.{i}.mlp" for i in range(LAYERS)], str(result)
    tokens = ids()
    with torch.no_grad():
        assert_close(model(tokens).logits, ref(tokens).logits, rtol=1e-4, atol=1e-5, name="logits")
    assert len(twell_compile.stats().layers) == LAYERS


@pytest.mark.parametrize("targets", [["gate_proj"], ["up_proj"], ["down_proj"], ["gate_proj", "up_proj", "down_proj"]])
def test_backend_twell_names_a_lora_adapted_ffn_and_the_remedy(targets):
    """Whichever projection carries the adapter, the skip says so (a projection plus a term) and
    names the FFN by its path in the PEFT model; ``strict=True`` raises."""
    import peft

    from tests.ffn_models import unwrap

    model, _ = llama(mlp_bias=False)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                                      init_lora_weights=False))
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with pytest.warns(RuntimeWarning, match="merge_and_unload"):
        torch.compile(lora, backend="twell", options={"inner": "aot_eager"})(input_ids=ids, labels=ids).loss.backward()
    report = twell_compile.report()
    assert not report.rewritten
    assert [s.reason for s in report.skipped] == [twell_compile.SkipReason.EXTRA_TERM] * LAYERS
    assert [s.where for s in report.skipped] == [f"base_model.model.model.layers.{i}.mlp" for i in range(LAYERS)]
    reset_state()
    with pytest.raises(Exception) as info:
        torch.compile(lora, backend="twell", options={"inner": "aot_eager", "strict": True})(input_ids=ids)
    assert isinstance(unwrap(info.value), twell_compile.TwellRewriteError)
