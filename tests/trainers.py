"""The training frameworks the tests drive as users do: a small Hugging Face Llama with its eager
oracle, and a Lightning fit."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tests.ffn_models import eager_loss


def small_llama():
    """A 2-layer Llama with ``hidden_act="relu"``, an untouched copy (the oracle) and a batch of 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = 50
    config = LlamaConfig(hidden_act="relu", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
                         max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    return model, copy.deepcopy(model), torch.randint(0, vocab, (8, 12))


def whole_batch_grads(ref, ids, l1) -> None:
    """The oracle: ``loss + l1 · L1`` on the whole batch, in eager PyTorch, backward into ``ref``."""
    mlps = [layer.mlp for layer in ref.model.layers]
    eager_loss(ref, lambda: ref(input_ids=ids, labels=ids), lambda out: out.loss, l1, modules=mlps,
               hidden_fn=lambda m, x: F.relu(m.gate_proj(x)) * m.up_proj(x)).backward()


def lightning_fit(model, ids, tmp_path, callbacks=(), accumulate: int = 2, steps: int = 1, log_every: int = 50):
    """Fit ``model`` (a causal LM) with Lightning on ``ids`` in micro-batches of 4, SGD at lr 0;
    returns the trainer and the gradients the optimizer got at its last step (parameter names of
    ``model``)."""
    import lightning.pytorch as pl

    grads = {}

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Grab(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.update({n.removeprefix("model."): p.grad.clone() for n, p in pl_module.named_parameters()})

    trainer = pl.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), log_every_n_steps=log_every,
                         callbacks=[Grab(), *callbacks])
    trainer.fit(Lit(), torch.utils.data.DataLoader(ids, batch_size=4))
    return trainer, grads
