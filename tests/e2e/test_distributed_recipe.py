"""``target_density`` under DDP, on CPU with gloo, 2 processes: every rank steers on the global
batch's density, so the coefficients are the same on both ranks, and those of one process trained
on the global batches.

``distributed_recipe_worker.py`` gives each rank data of its own distribution, so the ranks'
local densities differ: a controller that read only its own rank's counters would move each
rank's coefficients apart (docs/usage.md, "Training with the recipe").
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

import twell_compile

from tests.ffn_models import reset_state

WORKER = Path(__file__).with_name("distributed_recipe_worker.py")
_spec = importlib.util.spec_from_file_location("distributed_recipe_worker", WORKER)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWELL")}
    env.update(OMP_NUM_THREADS="1", TWELL_QUIET="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(WORKER), str(out), *W.ROUTES]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out / "results.pt")


@pytest.fixture(scope="module")
def one_process():
    """The same steps in one process, each on the concatenation of the ranks' batches."""
    reset_state()
    model = W.build()
    twell_compile.patch(model, **W.options())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(W.STEPS):
        model(torch.cat([W.batch(step, 0), W.batch(step, 1)])).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    coefficients = [s.l1_coeff for s in twell_compile.stats(model).layers]
    reset_state()
    return coefficients


@pytest.mark.parametrize("route", W.ROUTES)
def test_ranks_steer_on_the_global_density(results, one_process, route):
    first, second = results[route]["ranks"]
    # The ranks' own densities differ by far more than a controller step would hide.
    assert all(abs(a - b) > 0.03 for a, b in zip(first["densities"], second["densities"])), (first, second)
    assert first["coefficients"] == second["coefficients"]
    assert first["coefficients"] == pytest.approx(one_process, rel=1e-6)
    assert all(c != pytest.approx(W.L1, rel=1e-3) for c in one_process)  # the controller moved them
