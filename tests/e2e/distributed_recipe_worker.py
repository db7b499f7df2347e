"""Run by ``torchrun --nproc_per_node 2`` from ``test_distributed_recipe.py`` (CPU, gloo); not a test itself.

Trains a two-layer residual ReLU FFN stack under DDP with ``target_density`` for ``STEPS`` steps,
each rank on data of its own distribution (so its own density differs from the other's), on every
route named on the command line, and saves on rank 0 each rank's final per-layer coefficients and
last local densities. The learning rate is 0: the weights, hence each batch's density, stay those
of one process, so the test can replay the run in one process on the global batches.

Usage: torchrun --nproc_per_node 2 distributed_recipe_worker.py OUT ROUTE [ROUTE ...]
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

D, H, STEPS, L1, TARGET = 16, 64, 20, 1e-3, 0.7
ROUTES = ("ddp-patch", "ddp-compile")


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.down(torch.relu(self.gate(x)) * self.up(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([FFN(), FFN()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def build() -> Stack:
    """Gate biases of 0.5: small inputs fire almost every neuron, large ones about half."""
    torch.manual_seed(0)
    model = Stack()
    with torch.no_grad():
        for layer in model.layers:
            layer.gate.bias.fill_(0.5)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank 0's tokens are small (~100% dense), rank 1's large (~50%), on either side of TARGET."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, D, generator=g) * (10.0 if rank else 0.1)


def options() -> dict:
    return {"l1_coeff": L1, "target_density": TARGET, "l1_coeff_max": 1.0}


def run(route: str) -> dict:
    import twell_compile
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = build()
    if route == "ddp-patch":
        twell_compile.patch(model, **options())
        step_fn = DDP(model)
    elif route == "ddp-compile":
        step_fn = torch.compile(DDP(model), backend="twell", options={"inner": "aot_eager", **options()})
    else:
        raise SystemExit(f"unknown route {route!r}")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(STEPS):
        step_fn(batch(step, rank)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rows = twell_compile.stats(model).layers
    mine = {"coefficients": [s.l1_coeff for s in rows], "densities": [s.density for s in rows]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def main() -> None:
    from distributed_worker import exit_now, run_routes  # the script's folder is first on sys.path

    run_routes(run, sys.argv[1], sys.argv[2:])
    exit_now()


if __name__ == "__main__":
    main()
