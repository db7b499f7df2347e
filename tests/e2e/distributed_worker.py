"""Run by ``torchrun --nproc_per_node 2`` from ``test_distributed.py`` (CPU, gloo); not a test itself.

Trains the tiny ReLU Llama of ``tests/e2e/test_distributed.py`` for ``STEPS`` SGD steps on each
rank's half of one global batch, on every route named on the command line, and saves on rank 0
each step's loss (averaged over the ranks) and every parameter's full gradient, for the test to
compare with one process on the whole batch. ``--unmodified`` runs the plain script (DDP or
FSDP2, no twell import), which ``TWELL=1`` in the environment must turn into twell's.

Usage: torchrun --nproc_per_node 2 distributed_worker.py OUT ROUTE [ROUTE ...]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

VOCAB, STEPS, LR, L1 = 96, 2, 0.1, 0.05
GLOBAL_BATCH, SEQ = 4, 10


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # Each FFN weight is 1 MiB in float32, as large as DDP's first bucket, so 1 MiB buckets cut FFNs.
    cfg = LlamaConfig(hidden_act="relu", hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=32, attention_dropout=0.0)
    return LlamaForCausalLM(cfg)


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def full_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()


def wrap(route: str, model):
    """The model as the route runs it: ``(callable, module whose parameters train)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not route.startswith("unmodified"):
        import twell_compile

    options = {"inner": "aot_eager", "l1_coeff": L1}
    if route == "ddp-patch-before":
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
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if route == "fsdp-patch-after":
            twell_compile.patch(model, l1_coeff=L1)
        if route == "fsdp-compile-per-layer":
            for layer in model.model.layers:
                layer.compile(backend="twell", options=options)
        if route == "fsdp-compile-whole":
            return torch.compile(model, backend="twell", options=options), model
        return model, model
    if route == "unmodified-ddp":  # TWELL=1 must do everything
        return DDP(model), model
    if route == "unmodified-fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    raise SystemExit(f"unknown route {route!r}")


def run(route: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    run_model, params = wrap(route, model)
    opt = torch.optim.SGD(params.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        ids = global_batch(step).chunk(world)[rank]
        loss = run_model(input_ids=ids, labels=ids).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        grads.append({n: full_grad(p) for n, p in params.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    result = {"losses": losses, "grads": grads}
    if "twell_compile" in sys.modules:
        import twell_compile

        rows = twell_compile.stats().layers
        result["layers"] = sorted({s.where for s in rows})
        result["rewritten"] = len(twell_compile.report().rewritten)
        result["local_tokens"] = sorted(s.tokens for s in rows)
        result["reduced_tokens"] = sorted(s.tokens for s in twell_compile.stats(reduce=True).layers)
    return result


def main() -> None:
    out, routes = sys.argv[1], sys.argv[2:]
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
