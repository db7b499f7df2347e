"""What real clients do with a twell model: copy it, save it, add LoRA adapters, checkpoint its
activations, and train it with the Hugging Face Trainer under ``TWELL=1``.

The oracle is always the same model without twell, in eager PyTorch, with the L1 term
``l1_coeff · mean over the FFNs of (1/T) Σ|h|`` added to its loss (docs/architecture.md, "The L1
regularizer"), ``h = act(gate(x)) · up(x)`` read from each MLP as the model computes it (with its
adapters, when it has them).
"""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import twell_compile
from twell_compile import SkipReason

from tests.e2e.test_twell_env import twell_1  # noqa: F401 - the fixture: TWELL=1 in this process
from tests.ffn_models import assert_close, assert_grads_close, eager_loss, reset_state
from tests.trainers import lightning_fit, small_llama, whole_batch_grads

import transformers

VOCAB, L1 = 96, 0.05


@pytest.fixture(autouse=True)
def _fresh():
    reset_state()
    yield
    reset_state()


def llama(layers: int = 2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_act="relu", hidden_size=32, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                   max_position_embeddings=32, attention_dropout=0.0)
    return transformers.LlamaForCausalLM(cfg)


def tokens(seed: int = 1):
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed))


def mlps(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp")]


def oracle_backward(model, ids, l1=L1):
    """``loss + l1 · mean_l (1/T) Σ|h_l|`` of the plain model, back-propagated."""
    loss = eager_loss(model, lambda: model(input_ids=ids, labels=ids), lambda out: out.loss, l1, modules=mlps(model),
                      hidden_fn=lambda m, x: m.act_fn(m.gate_proj(x)) * m.up_proj(x))
    loss.backward()


def train_loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


# ---------------------------------------------------------------------------------------------
# Copies and saved models
# ---------------------------------------------------------------------------------------------


def test_a_deepcopy_of_a_patched_model_computes_with_its_own_weights():
    model = llama()
    twell_compile.patch(model, l1_coeff=L1)
    model(input_ids=tokens())  # patched and used, as an EMA or teacher copy would be
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for mlp in mlps(twin):
            mlp.down_proj.weight.zero_()
    with torch.no_grad():
        assert not torch.allclose(twin(input_ids=tokens()).logits, model(input_ids=tokens()).logits)
    # The copy trains exactly, with its own layers (its own L1 mean and telemetry rows).
    plain = llama()
    plain.load_state_dict(twin.state_dict())
    train_loss(twin, tokens())
    oracle_backward(plain, tokens())
    assert_grads_close(twin, plain, rtol=1e-4, atol_frac=1e-5)
    assert len(twell_compile.stats(twin).layers) == 2 and len(twell_compile.stats(model).layers) == 2


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_patched_model_saves_and_loads_whole(how):
    model = llama()
    twell_compile.patch(model, l1_coeff=L1)
    buffer = io.BytesIO()
    if how == "torch.save":
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    else:
        import pickle

        loaded = pickle.loads(pickle.dumps(model))
    plain = llama()
    plain.load_state_dict(loaded.state_dict())
    with torch.no_grad():
        assert_close(loaded(input_ids=tokens()).logits, plain(input_ids=tokens()).logits, rtol=1e-5, atol=1e-6, name="logits")
    train_loss(loaded, tokens())
    oracle_backward(plain, tokens())
    assert_grads_close(loaded, plain, rtol=1e-4, atol_frac=1e-5)


def test_load_state_dict_dtype_moves_and_hooks_behave_as_on_a_plain_module():
    model = llama()
    twell_compile.patch(model, l1_coeff=L1)
    other = llama()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    model.load_state_dict(other.state_dict())
    seen, seen_down = [], []
    handle = mlps(model)[0].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    # A hook on a projection: the op would bypass it, so that FFN runs its own forward, and says so.
    down_handle = mlps(model)[1].down_proj.register_forward_hook(lambda mod, args, out: seen_down.append(out.shape))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="layers.1.mlp runs its own forward.*down_proj .*hooks"):
        assert_close(model(input_ids=tokens()).logits, other(input_ids=tokens()).logits, rtol=1e-5, atol=1e-6, name="loaded")
    handle.remove()
    down_handle.remove()
    with torch.no_grad():
        model(input_ids=tokens())
    assert len(seen) == 1 and len(seen_down) == 1  # each hook ran once, and is gone after remove()
    assert [s.where for s in twell_compile.report().skipped if s.reason is SkipReason.PATCH_FALLBACK] == ["model.layers.1.mlp"]
    model.to(torch.float64)
    other.to(torch.float64)
    with torch.no_grad():
        assert_close(model(input_ids=tokens()).logits, other(input_ids=tokens()).logits, rtol=1e-9, atol=1e-10, name="float64")


# ---------------------------------------------------------------------------------------------
# PEFT
# ---------------------------------------------------------------------------------------------


def _lora(model, targets):
    import peft
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


@pytest.mark.parametrize("targets", [["gate_proj", "up_proj", "down_proj"], ["q_proj", "v_proj", "gate_proj", "down_proj"]],
                         ids=["ffn adapters", "ffn and attention adapters"])
def test_lora_adapters_added_after_patching_are_not_bypassed(targets):
    """TWELL=1's order: the model is patched on its first call, then wrapped by PEFT. The patched
    FFNs merge the adapters at call time: output and every gradient (LoRA's A and B included)
    equal the uncompiled PEFT model's."""
    model = llama()
    ref = copy.deepcopy(model)
    twell_compile.patch(model, l1_coeff=L1)
    model(input_ids=tokens())
    peft_model = _lora(model, targets)
    peft_ref = _lora(ref, targets)
    peft_ref.load_state_dict(peft_model.state_dict())
    with torch.no_grad():
        assert_close(peft_model(input_ids=tokens()).logits, peft_ref(input_ids=tokens()).logits, rtol=1e-5, atol=1e-6,
                     name="logits")
    train_loss(peft_model, tokens())
    oracle_backward(peft_ref, tokens())
    lora_grads = [n for n, p in peft_model.named_parameters() if "lora_" in n and p.grad is not None]
    assert any("mlp" in n for n in lora_grads), lora_grads
    assert_grads_close(peft_model, peft_ref, rtol=1e-4, atol_frac=1e-5)


def test_a_lora_layer_with_dropout_runs_the_modules_own_forward_and_says_so():
    import peft
    model = llama()
    twell_compile.patch(model, l1_coeff=L1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["gate_proj"])
    peft_model = peft.get_peft_model(model, cfg).train()
    with pytest.warns(RuntimeWarning, match="runs its own forward.*dropout"):
        peft_model(input_ids=tokens())
    assert any(s.reason is SkipReason.PATCH_FALLBACK for s in twell_compile.report().skipped)


def test_backend_twell_on_a_lora_model_reports_the_adapters():
    model = _lora(llama(), ["gate_proj", "up_proj"])
    with pytest.warns(RuntimeWarning, match="no FFN of .* has been rewritten"):
        torch.compile(model, backend="twell", options={"inner": "aot_eager"})(input_ids=tokens())
    report = twell_compile.report()
    assert not report.rewritten
    assert report.skipped and all(s.reason is SkipReason.EXTRA_TERM for s in report.skipped), str(report)
    assert all("mlp" in s.where and "layers" in s.where for s in report.skipped), str(report)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------


def test_gradient_checkpointing_with_backend_twell_keeps_the_l1_term():
    """HF's gradient_checkpointing_enable(): Dynamo breaks the graph at each checkpointed layer, so
    the backend patches the FFN modules, which then run the TwELL op inside the checkpoint."""
    model = llama()
    plain = copy.deepcopy(model).train()  # checkpointing does not change the gradients
    model.gradient_checkpointing_enable()
    model.train()
    compiled = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": L1})
    train_loss(compiled, tokens())
    assert len(twell_compile.stats(model).layers) == 2
    oracle_backward(plain, tokens())
    assert_grads_close(model, plain, rtol=1e-4, atol_frac=1e-5)


CHECKPOINTING_SCRIPT = textwrap.dedent(
    """
    import sys, torch, transformers

    def llama():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_act="relu", hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=96, max_position_embeddings=32, attention_dropout=0.0))

    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    saved = {}
    for route in ("eager", "compiled"):  # the first model called is patched by the hook, the second by the wrapper
        model = llama()
        saved["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.gradient_checkpointing_enable()
        model.train()
        run = torch.compile(model, backend="aot_eager") if route == "compiled" else model
        run(input_ids=ids, labels=ids).loss.backward()
        saved[route] = {n: p.grad for n, p in model.named_parameters()}
    torch.save(saved, sys.argv[1])
    """
)


def test_gradient_checkpointing_under_twell_1_keeps_the_l1_term(tmp_path):
    script = tmp_path / "checkpointing.py"
    script.write_text(CHECKPOINTING_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWELL")}
    env.update(TWELL="1", TWELL_L1=str(L1))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "grads.pt")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = torch.load(tmp_path / "grads.pt")
    plain = llama()
    plain.load_state_dict(saved["state"])
    oracle_backward(plain, tokens())
    for route in ("eager", "compiled"):
        for name, p in plain.named_parameters():
            got = saved[route][name]
            assert_close(got, p.grad, rtol=1e-4, atol=1e-5 * (1 + float(p.grad.abs().max())), name=f"{route} {name}")


# ---------------------------------------------------------------------------------------------
# accelerate's regional compilation under TWELL=1
# ---------------------------------------------------------------------------------------------

def test_accelerate_regional_compilation_under_twell_1(twell_1):
    """``compile_regions`` compiles each decoder block on its own (``use_regional_compilation``):
    the L1 term is still the mean over the model's two FFNs, which carry their full names."""
    from accelerate.utils import compile_regions

    model = llama().train()
    plain = copy.deepcopy(model)
    compiled = compile_regions(model, backend="aot_eager")
    train_loss(compiled, tokens())  # the blocks' copies share the model's parameters
    oracle_backward(plain, tokens(), l1=twell_1)
    assert_grads_close(model, plain, rtol=1e-4, atol_frac=1e-5)
    assert [r.where for r in twell_compile.report().rewritten] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert len(twell_compile.stats(model).layers) == 2


# ---------------------------------------------------------------------------------------------
# TWELL=1 with Lightning
# ---------------------------------------------------------------------------------------------

def test_lightning_under_twell_1_gets_the_callback_and_trains_the_whole_batch_term(twell_1, tmp_path):
    """An unmodified Lightning script under ``TWELL=1`` with ``accumulate_grad_batches=2``: the
    model's FFNs are patched at its first call, ``TwellLightningCallback`` joins the Trainer there,
    and the gradients the optimizer gets are those of ``loss + l1_coeff · L1`` on the whole batch."""
    from twell_compile.integrations import TwellLightningCallback

    model, ref, ids = small_llama()
    trainer, grads = lightning_fit(model, ids, tmp_path)
    assert sum(isinstance(cb, TwellLightningCallback) for cb in trainer.callbacks) == 1
    assert [r.where for r in twell_compile.report().rewritten] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    whole_batch_grads(ref, ids, twell_1)
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * (1 + float(p.grad.abs().max())), name=name)

# ---------------------------------------------------------------------------------------------
# TWELL=1 with the Hugging Face Trainer, in a fresh process
# ---------------------------------------------------------------------------------------------

TRAINER_SCRIPT = textwrap.dedent(
    """
    import sys, torch, transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer,
                              TrainingArguments)

    text = open(sys.argv[1]).read()
    chars = sorted(set(text))
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = tokenizer(text)["input_ids"]
    block = 16
    examples = [{"input_ids": ids[i:i + block], "labels": ids[i:i + block]}
                for i in range(0, len(ids) - block, block)][:16]

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_act="relu", hidden_size=32, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         vocab_size=len(chars), max_position_embeddings=32))
    args = TrainingArguments(output_dir=sys.argv[2], max_steps=3, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=examples)
    result = trainer.train()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, sys.argv[3])
    import twell_compile
    print("REWRITTEN", len(twell_compile.report().rewritten))
    print("LOGGED", sorted(k for entry in trainer.state.log_history for k in entry if k.startswith("twell/")))
    print("LOSS", result.training_loss)
    """
)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """The Trainer script without TWELL, and under TWELL=1 with TWELL_L1=0 (and TWELL_QUIET=1) and
    TWELL_L1=1e-2, in parallel: ``name -> (process, final weights)``."""
    tmp = tmp_path_factory.mktemp("trainer")
    script = tmp / "train.py"
    script.write_text(TRAINER_SCRIPT)
    text = tmp / "text.txt"
    text.write_text(Path(transformers.__file__).read_text()[:20000])
    cases = {"baseline": {}, "l1=0": {"TWELL": "1", "TWELL_L1": "0", "TWELL_QUIET": "1"},
             "l1=1e-2": {"TWELL": "1", "TWELL_L1": "1e-2"}}
    procs = {}
    for name, extra in cases.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("TWELL")}
        env.update(extra)
        weights = tmp / f"{name}.pt"
        cmd = [sys.executable, str(script), str(text), str(tmp / f"out-{name}"), str(weights)]
        procs[name] = (subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                       cmd, weights)
    runs = {}
    for name, (popen, cmd, weights) in procs.items():
        stdout, stderr = popen.communicate(timeout=600)
        assert popen.returncode == 0, f"{name}:\n{stderr[-4000:]}"
        runs[name] = (subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr), torch.load(weights))
    return runs


def _relative_change(weights, baseline, only: str = "") -> float:
    """``‖W − W₀‖ / ‖W₀‖`` over all the (``only``-named) weights at once: Adam turns the last-bit
    differences of a gradient near 0 into whole-step ones in single elements, not in the norm."""
    keys = [k for k in baseline if only in k]
    diff = sum(float((weights[k] - baseline[k]).double().square().sum()) for k in keys)
    return (diff / sum(float(baseline[k].double().square().sum()) for k in keys)) ** 0.5


def test_trainer_under_twell_1_trains_with_the_l1_term(trainer_runs):
    """TWELL_L1=0 trains as without twell; TWELL_L1=1e-2 reaches the weights, the FFNs' most."""
    baseline = trainer_runs["baseline"][1]
    assert _relative_change(trainer_runs["l1=0"][1], baseline) < 1e-6
    assert _relative_change(trainer_runs["l1=1e-2"][1], baseline, only="mlp") > 1e-3


def test_trainer_under_twell_1_rewrites_says_so_and_logs_telemetry(trainer_runs):
    proc = trainer_runs["l1=1e-2"][0]
    assert "REWRITTEN 2" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("twell: rewrote")]
    assert len(lines) == 1 and "of LlamaForCausalLM (model.layers.*.mlp)" in lines[0] and "l1_coeff 0.01" in lines[0], \
        proc.stderr[-2000:]
    logged = proc.stdout.split("LOGGED", 1)[1].splitlines()[0]
    for key in ("twell/density", "twell/l1", "twell/l1_coeff", "twell/sparse_layers"):
        assert key in logged, logged


def test_twell_quiet_silences_the_summary_line(trainer_runs):
    proc = trainer_runs["l1=0"][0]
    assert "REWRITTEN 2" in proc.stdout
    assert not any(ln.startswith("twell:") for ln in proc.stderr.splitlines()), proc.stderr[-2000:]
