"""DDP and FSDP2 with twell, on CPU with gloo, 2 processes: the same training as one process.

``distributed_worker.py`` trains a tiny ReLU Llama for two SGD steps on each rank's half of the
same global batch, on every route below, under ``torchrun --nproc_per_node 2``. The oracle is one
process, eager, on the whole batch: ``loss + l1_coeff · mean over layers of (1/T) Σ|h|`` with T
the global batch's tokens (docs/distributed.md, "The L1 term under data parallelism"). With the
ranks' equal token counts, DDP's average of per-rank means is that mean. ``l1_coeff`` is large
enough that dropping the term, or counting it per graph, moves the gradients far past the
tolerances.

Routes: DDP with ``patch()`` before and after wrapping; DDP compiled with ``backend="twell"``,
with DDPOptimizer cutting 1 MiB buckets (inside the FFNs) and with ``optimize_ddp=False``;
FSDP2 (``fully_shard`` per decoder layer and at the root) with ``patch()`` before and after
sharding, compiled per layer, and compiled whole, on the Llama and on a model of identical
decoder blocks (torchtitan's shape, which Dynamo would serve one graph); unmodified DDP and FSDP2
scripts under ``TWELL=1``; and DDP with ranks of 1 and 3 sequences, whose term is the average of
the ranks' means, as DDP averages gradients (docs/distributed.md).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ffn_models import assert_close, eager_loss

import transformers  # noqa: F401

WORKER = Path(__file__).with_name("distributed_worker.py")
_spec = importlib.util.spec_from_file_location("distributed_worker", WORKER)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)

ROUTES = ["ddp-patch-before", "ddp-patch-after", "ddp-compile", "ddp-compile-no-optimize-ddp", "ddp-patch-uneven",
          "fsdp-patch-before", "fsdp-patch-after", "fsdp-compile-per-layer", "fsdp-compile-whole",
          "fsdp-titan-compile-per-layer", "fsdp-titan-compile-whole"]
UNMODIFIED = ["unmodified-ddp", "unmodified-fsdp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path: Path, routes: list[str], **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWELL")}
    env.update(env_extra, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(WORKER), str(tmp_path), *routes]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(tmp_path / "results.pt")


def _oracle(kind: str, route: str = "") -> tuple[list[float], list[dict]]:
    """One process, eager: losses and gradients of each step, of the whole global batch (the
    average over the ranks' batches for the ``uneven`` route, as DDP averages gradients)."""
    model = W.build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=W.LR)
    mlps = [layer.mlp for layer in W.decoder_layers(model)]
    losses, grads = [], []
    for step in range(W.STEPS):
        batches = W.rank_batches(route, step, 2) if "uneven" in route else [W.global_batch(step)]
        total, lm_total = 0.0, 0.0
        for ids in batches:
            lm_losses = []

            def lm_loss(loss):
                lm_losses.append(loss.detach())
                return loss

            total = total + eager_loss(model, lambda: W.loss_of(kind, model, ids), lm_loss, W.L1, modules=mlps,
                                       hidden_fn=W.hidden)
            lm_total += float(lm_losses[0])
        (total / len(batches)).backward()
        losses.append(lm_total / len(batches))
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


@pytest.fixture(scope="module")
def oracles():
    cache = {}

    def get(route: str):
        key = (W.kind_of(route), "uneven" in route)
        if key not in cache:
            cache[key] = _oracle(W.kind_of(route), route)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _torchrun(tmp_path_factory.mktemp("routes"), ROUTES)


@pytest.fixture(scope="module")
def unmodified(tmp_path_factory):
    # One process per script: TWELL=1 patches the first model a process calls.
    return {route: _torchrun(tmp_path_factory.mktemp(route), [route], TWELL="1", TWELL_L1=str(W.L1), TWELL_QUIET="1")[route]
            for route in UNMODIFIED}


def _check(result: dict, oracle, route: str) -> None:
    losses, grads = oracle
    assert result["losses"] == pytest.approx(losses, rel=1e-5), route
    for step, (got, want) in enumerate(zip(result["grads"], grads)):
        assert set(got) == set(want), f"{route}: parameters with gradients differ"
        for name, g in got.items():
            w = want[name]
            assert_close(g, w, rtol=1e-4, atol=1e-5 * (1 + float(w.abs().max())), name=f"{route} step {step} {name}")
    prefix = "" if W.kind_of(route) == "titan" else "model."
    assert result["layers"] == [f"{prefix}layers.0.mlp", f"{prefix}layers.1.mlp"], result["layers"]
    assert result["rewritten"] >= 2, result["rewritten"]
    assert result["reduced_tokens"] == [W.GLOBAL_BATCH * W.SEQ] * 2, result["reduced_tokens"]
    if "fsdp" in route:
        assert result["weight_copies_saved"] == 0, result["weight_copies_saved"]
    if route != "fsdp-patch-before":  # patched before sharding: the layers were registered unsharded
        assert result["gathered"] == ["fsdp" in route] * 2, result["gathered"]


@pytest.mark.parametrize("route", ROUTES)
def test_two_ranks_train_as_one_process(results, oracles, route):
    _check(results[route], oracles(route), route)


@pytest.mark.parametrize("route", UNMODIFIED)
def test_twell_1_with_an_unmodified_distributed_script(unmodified, oracles, route):
    _check(unmodified[route], oracles(route), route)


TRAINER_SCRIPT = '''
import json, os, sys, torch
from torch.utils.data import SequentialSampler
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class InOrder(Trainer):  # the same global batches on 1 and on 2 processes
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


per_device, out = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(5)
examples = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (24, 10), generator=g).tolist()]
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_act="relu", hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, vocab_size=96,
                                     max_position_embeddings=32))
args = TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=per_device, learning_rate=5e-3,
                         logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                         dataloader_drop_last=True)
trainer = InOrder(model=model, args=args, train_dataset=examples)
trainer.train()
import twell_compile
if int(os.environ.get("RANK", "0")) == 0:
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    json.dump({"losses": losses, "rewritten": len(twell_compile.report().rewritten)}, open(os.path.join(out, "trainer.json"), "w"))
# Exit without the interpreter's teardown (see EXIT_NOTE in distributed_worker.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


ACCELERATE_SCRIPT = '''
import json, os, sys, torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

per_device, out = int(sys.argv[1]), sys.argv[2]
acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_act="relu", hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, vocab_size=96,
                                     max_position_embeddings=32))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
losses = []
for step in range(3):
    ids = torch.randint(0, 96, (4, 10), generator=torch.Generator().manual_seed(100 + step))
    ids = ids[acc.process_index * per_device:(acc.process_index + 1) * per_device]
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(float(acc.reduce(loss.detach(), reduction="mean")))
import twell_compile
if acc.is_main_process:
    json.dump({"losses": losses, "rewritten": len(twell_compile.report().rewritten)},
              open(os.path.join(out, "trainer.json"), "w"))
# Exit without the interpreter's teardown (see EXIT_NOTE in distributed_worker.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


def _one_and_two_processes(tmp_path: Path, source: str, l1: str) -> dict:
    """An unmodified script under TWELL=1: one process of 4 sequences, and two ranks of 2."""
    import json

    script = tmp_path / "script.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWELL")}
    env.update(TWELL="1", TWELL_L1=l1, TWELL_QUIET="1", OMP_NUM_THREADS="1")
    runs = {}
    for name, cmd in {
        "one": [sys.executable, str(script), "4", str(tmp_path / f"one{l1}")],
        "two": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(_free_port()), str(script), "2", str(tmp_path / f"two{l1}")],
    }.items():
        (tmp_path / f"{name}{l1}").mkdir()
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{name}:\n{proc.stderr[-5000:]}"
        runs[name] = json.loads((tmp_path / f"{name}{l1}" / "trainer.json").read_text())
    return runs


@pytest.mark.parametrize("client", ["trainer", "accelerate"])
def test_hf_trainer_and_accelerate_on_two_processes_train_as_one(tmp_path, client):
    """TWELL=1 with an unmodified Trainer or accelerate script: two ranks of 2 sequences each log
    the losses of one process of 4 (the same global batches, the L1 term on)."""
    source = TRAINER_SCRIPT if client == "trainer" else ACCELERATE_SCRIPT
    runs = _one_and_two_processes(tmp_path, source, "0.05")
    assert runs["one"]["rewritten"] == runs["two"]["rewritten"] == 2
    assert len(runs["one"]["losses"]) == 3
    assert runs["two"]["losses"] == pytest.approx(runs["one"]["losses"], rel=1e-5)
    if client == "accelerate":  # the term moves these losses far past the tolerance above
        without = _one_and_two_processes(tmp_path, source, "0")["one"]["losses"]
        assert without[2] != pytest.approx(runs["one"]["losses"][2], rel=1e-5)
