"""``torchrun --nproc_per_node N -m twell_compile.bench_distributed``: data-parallel training with
twell against Inductor, on N GPUs (docs/distributed.md).

One process per GPU (NCCL). A ReLU Llama (the paper's FFN width by default) with its gate biases
set for ``--density`` (as ``twell bench --e2e`` does), bf16, AdamW at learning rate 0 (so the
density stays where it was set while the steps are timed), under ``--engine ddp`` or ``fsdp2``
(``fully_shard`` per decoder layer and at the root), compiled with ``backend="twell"`` and then
``backend="inductor"`` in the same processes. Each rank trains on its own ``--batch`` sequences of
``--seq`` tokens. Rank 0 writes ``distributed_<engine>_<N>gpu.json``: tokens/s of a step (all
ranks' tokens), peak GPU memory per rank, and the per-step losses of a short run at learning rate
``--check-lr`` with the L1 term on, for ``compare``:

    python -m twell_compile.bench_distributed compare one.json two.json

checks that two runs of the same global batch (1 GPU with batch B·N, N GPUs with batch B) logged
the same losses within bf16's run-to-run spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _build(args, device):
    import torch
    from transformers import LlamaForCausalLM

    from .bench_e2e import calibrate_gate_biases, llama_config

    torch.manual_seed(0)
    cfg = llama_config(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
                       max_position_embeddings=args.seq)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    calibrate_gate_biases(model, torch.randint(0, args.vocab, (2, args.seq), generator=gen).to(device), args.density)
    return model


def _wrap(model, engine: str, device):
    import torch.distributed as dist

    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index])
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batches(args, rank: int, world: int, steps: int, device):
    import torch

    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        whole = torch.randint(0, args.vocab, (args.batch * world, args.seq), generator=gen)
        out.append(whole.chunk(world)[rank].to(device))
    return out


def _run(args, backend: str, lr: float, steps: int, device, rank: int, world: int, timed: bool):
    import torch
    import torch.distributed as dist

    import twell_compile

    torch._dynamo.reset()
    twell_compile.reset()
    model = _build(args, device)
    wrapped = _wrap(model, args.engine, device)
    options = {"l1_coeff": args.l1} if backend == "twell" else None
    compiled = torch.compile(wrapped, backend=backend, **({"options": options} if options else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    torch.cuda.reset_peak_memory_stats(device)
    for step, ids in enumerate(_batches(args, rank, world, steps, device)):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    result = {"losses": losses, "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    if timed:
        median = statistics.median(times[args.warmup:])
        result["tokens_per_s"] = args.batch * world * args.seq / median
        result["step_ms"] = 1e3 * median
    del compiled, wrapped, model, opt
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare(argv[1:])
    p = argparse.ArgumentParser(prog="python -m twell_compile.bench_distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["ddp", "fsdp2"], default="ddp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--density", type=float, default=0.005)
    p.add_argument("--l1", type=float, default=2e-5)
    p.add_argument("--steps", type=int, default=20, help="timed run: steps (learning rate 0)")
    p.add_argument("--warmup", type=int, default=8, help="steps of the timed run left out of the median")
    p.add_argument("--check-steps", type=int, default=6, help="the losses run: steps")
    p.add_argument("--check-lr", type=float, default=1e-4)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    report = {"engine": args.engine, "gpus": world, "args": {k: str(v) for k, v in vars(args).items()}}
    for backend in ("twell", "inductor"):
        timed = _run(args, backend, 0.0, args.steps, device, rank, world, timed=True)
        check = _run(args, backend, args.check_lr, args.check_steps, device, rank, world, timed=False)
        report[backend] = {"tokens_per_s": timed["tokens_per_s"], "step_ms": timed["step_ms"],
                           "peak_gib_rank0": timed["peak_gib"], "losses": check["losses"]}
    report["speedup"] = report["twell"]["tokens_per_s"] / report["inductor"]["tokens_per_s"]
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"distributed_{args.engine}_{world}gpu.json"
        path.write_text(json.dumps(report, indent=1))
        print(f"{args.engine} on {world} GPU(s): twell {report['twell']['tokens_per_s']:,.0f} tok/s, inductor "
              f"{report['inductor']['tokens_per_s']:,.0f} tok/s, speedup {report['speedup']:.3f}x; wrote {path}")
    dist.destroy_process_group()
    return 0


def compare(paths: list[str], rel: float = 2e-2) -> int:
    """Per-step losses of two runs agree within ``rel`` (bf16's run-to-run spread), per backend."""
    one, two = (json.loads(Path(p).read_text()) for p in paths)
    ok = True
    for backend in ("twell", "inductor"):
        for step, (a, b) in enumerate(zip(one[backend]["losses"], two[backend]["losses"])):
            if abs(a - b) > rel * abs(a):
                print(f"{backend} step {step}: {a:.5f} against {b:.5f}")
                ok = False
    print("losses agree" if ok else "losses differ")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
