"""Shared pytest configuration for the whole test tree."""

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a GPU the Triton kernels run in the interpreter. This must happen before any kernel
# module is imported (docs/architecture.md, 'Testing'), and conftest.py is imported before the test modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis profiles (docs/architecture.md, 'Testing'). Pick one with HYPOTHESIS_PROFILE (default "ci"):
#   ci       : few examples, derandomized so CI runs are reproducible; no deadline (the dense
#              float64 oracle and first-call warm-up make per-example times uneven).
#   thorough : many examples, random, for local or nightly runs:
#              HYPOTHESIS_PROFILE=thorough python -m pytest tests/kernels -m "not gpu"
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=400,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_REPORTED_PACKAGES = ("torch", "triton", "transformers", "hypothesis", "numpy", "pytest", "kernels", "peft", "accelerate",
                      "lightning")


def pytest_terminal_summary(terminalreporter):
    """One line, printed even under ``-q``, that says which versions this run was proven on."""
    from importlib import metadata

    found = []
    for name in _REPORTED_PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    terminalreporter.write_line(f"versions: Python {sys.version.split()[0]}, {', '.join(found)}; {cuda}")


def pytest_collection_modifyitems(config, items):
    """GPU tests skip, saying why, where there is no CUDA device (e.g. ``-m "slow or not slow"``
    on a CPU machine), instead of failing on their first ``.cuda()``."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where test tensors live: the GPU when there is one, else the CPU (interpreted kernels)."""
    return "cuda" if torch.cuda.is_available() else "cpu"
