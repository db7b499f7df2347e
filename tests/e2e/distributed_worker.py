"""Run by ``torchrun --nproc_per_node 2`` from ``test_distributed.py`` (CPU, gloo); not a test itself.

Trains a tiny ReLU Llama (or, on the ``titan`` routes, a model of identical decoder blocks, which
Dynamo would serve one compiled graph) for ``STEPS`` SGD steps on each rank's share of one global
batch, on every route named on the command line, and saves on rank 0 each step's loss (averaged
over the ranks) and every parameter's full gradient, for the test to compare with one process.
The ``uneven`` route gives the ranks 1 and 3 sequences. The ``unmodified`` routes run the plain
script (DDP or FSDP2, no twell import), which ``TWELL=1`` in the environment must turn into
twell's.

Usage: torchrun --nproc_per_node 2 distributed_worker.py OUT ROUTE [ROUTE ...]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

VOCAB, STEPS, LR, L1 = 96, 2, 0.1, 0.05
GLOBAL_BATCH, SEQ = 4, 10


class MLP(torch.nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.gate, self.up, self.down = torch.nn.Linear(d, h), torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def hidden(self, x):
        return torch.relu(self.gate(x)) * self.up(x)

    def forward(self, x):
        return self.down(torch.relu(self.gate(x)) * self.up(x))


class Block(torch.nn.Module):
    """A torchtitan-style decoder block: nothing in it differs from one block to the next."""

    def __init__(self, d: int = 32, h: int = 96):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.mlp = MLP(d, h)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Titan(torch.nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(2))
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), input_ids.flatten())


def kind_of(route: str) -> str:
    return "titan" if "titan" in route else "llama"


def build(kind: str = "llama"):
    torch.manual_seed(0)
    if kind == "titan":
        return Titan()
    from transformers import LlamaConfig, LlamaForCausalLM

    # Each FFN weight is 1 MiB in float32, as large as DDP's first bucket, so 1 MiB buckets cut FFNs.
    cfg = LlamaConfig(hidden_act="relu", hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=32, attention_dropout=0.0)
    return LlamaForCausalLM(cfg)


def decoder_layers(model):
    return model.layers if isinstance(model, Titan) else model.model.layers


def loss_of(kind: str, model, ids):
    """``model`` (perhaps wrapped: DDP, compiled) on ``ids``: the language-model loss."""
    return model(ids) if kind == "titan" else model(input_ids=ids, labels=ids).loss


def hidden(mlp, x):
    """The FFN's ``h``, whose L1 the backend regularises."""
    return mlp.hidden(x) if hasattr(mlp, "hidden") else mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def rank_batches(route: str, step: int, world: int) -> list[torch.Tensor]:
    """Each rank's sequences: equal halves, or 1 and 3 on the ``uneven`` route."""
    ids = global_batch(step)
    return list(ids.split([1, GLOBAL_BATCH - 1])) if "uneven" in route else list(ids.chunk(world))


def full_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()


def wrap(route: str, model):
    """The model as the route runs it: ``(callable, module whose parameters train)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not route.startswith("unmodified"):
        import twell_compile

    options = {"inner": "aot_eager", "l1_coeff": L1}
    if route in ("ddp-patch-before", "ddp-patch-uneven"):
        twell_compile.patch(model, l1_coeff=L1)
        ddp = DDP(model)
        return ddp, model
    if route == "ddp-patch-after":
        ddp = DDP(model)
        twell_compile.patch(ddp, l1_coeff=L1)
        return ddp, model
    if route in ("ddp-compile", "ddp-compile-no-optimize-ddp"):
        torch._dynamo.config.optimize_ddp = route == "ddp-compile"
        ddp = DDP(model, bucket_cap_mb=1)  # 1 MiB buckets: DDPOptimizer cuts inside the FFNs
        return torch.compile(ddp, backend="twell", options=options), model
    if route.startswith("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if route == "fsdp-patch-before":
            twell_compile.patch(model, l1_coeff=L1)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if route == "fsdp-patch-after":
            twell_compile.patch(model, l1_coeff=L1)
        if route.endswith("compile-per-layer"):
            for layer in decoder_layers(model):
                layer.compile(backend="twell", options=options)
        if route.endswith("compile-whole"):
            return torch.compile(model, backend="twell", options=options), model
        return model, model
    if route == "unmodified-ddp":  # TWELL=1 must do everything
        return DDP(model), model
    if route == "unmodified-fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    raise SystemExit(f"unknown route {route!r}")


def saving(found: list, model):
    """A pack hook that keeps the saved tensors shaped like one of ``model``'s weight matrices, or
    its transpose."""
    shapes = {s for p in model.parameters() if p.dim() == 2 for s in (tuple(p.shape), tuple(p.shape)[::-1])}

    def pack(t):
        if tuple(t.shape) in shapes:
            found.append(t)
        return t

    return pack


def bytes_held(t: torch.Tensor) -> int:
    """The memory a saved tensor holds that is not a parameter's (a parameter, or a view of one,
    is freed or kept by FSDP2 itself); fake tensors seen while tracing hold none."""
    if isinstance(t, torch._subclasses.FakeTensor) or isinstance(t, torch.nn.Parameter) or \
            isinstance(t._base, torch.nn.Parameter):
        return 0
    try:
        return t.untyped_storage().nbytes()
    except RuntimeError:
        return 0


def run(route: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(kind_of(route))
    run_model, params = wrap(route, model)
    opt = torch.optim.SGD(params.parameters(), lr=LR)
    losses, grads, saved_copies = [], [], []
    for step in range(STEPS):
        ids = rank_batches(route, step, world)[rank]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(saving(saved, params), lambda t: t):
            loss = loss_of(kind_of(route), run_model, ids)
        # After the forward FSDP2 has freed its unsharded weights: a weight-sized tensor saved for
        # the backward that still holds memory is a copy outliving the reshard.
        saved_copies += [bytes_held(t) for t in saved]
        del saved
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        grads.append({n: full_grad(p) for n, p in params.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    result = {"losses": losses, "grads": grads, "weight_copies_saved": sum(saved_copies)}
    if "twell_compile" in sys.modules:
        import twell_compile

        rows = twell_compile.stats().layers
        result["layers"] = sorted({s.where for s in rows})
        result["rewritten"] = len(twell_compile.report().rewritten)
        result["local_tokens"] = sorted(s.tokens for s in rows)
        result["reduced_tokens"] = sorted(s.tokens for s in twell_compile.stats(reduce=True).layers)
        from twell_compile.lowering.weight_cache import GATHERED_WEIGHT_LAYERS

        # FSDP2 frees unsharded weights after each use: no per-weight cache may outlive that.
        result["gathered"] = sorted(s.layer in GATHERED_WEIGHT_LAYERS for s in rows)
    return result


# EXIT_NOTE: the workers and scripts end with ``os._exit(0)`` once their results are written. On
# this CPU build (torch 2.13, gloo), a process that has imported ``torch._dynamo`` sometimes aborts
# in the interpreter's teardown ("terminate called without an active exception", SIGABRT), after
# its work is done, more often under load: seen without twell too (a plain accelerate script that
# imports torch._dynamo, 2 of 10 runs with two other busy processes), never with ``os._exit``.
def exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    run_routes(run, sys.argv[1], sys.argv[2:])
    exit_now()


def run_routes(run, out: str, routes: list[str]) -> None:
    """``run(route)`` for each route, from a fresh Dynamo and twell state, on every rank; rank 0
    saves the results to ``out/results.pt``."""
    dist.init_process_group("gloo")
    results = {}
    for route in routes:
        torch._dynamo.reset()
        if "twell_compile" in sys.modules:
            import twell_compile

            twell_compile.reset()
        results[route] = run(route)
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
