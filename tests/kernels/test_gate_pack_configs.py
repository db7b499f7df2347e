"""kernels/gate_pack_configs.py: how ``gate_pack`` launches, on made-up GPUs (host logic only).

Which TMA configs the autotuner times for a GPU's shared memory, whether any TMA config fits it at
all, and that a device's properties are queried once: no kernel runs, so these need no GPU.
"""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

GPC = importlib.import_module("twell_compile.kernels.gate_pack_configs")  # the module itself: tests patch its state


def test_device_properties_are_queried_once_per_device(monkeypatch):
    """The TMA choice and the persistent grid read a device's properties from a cache: the query
    cost ~5 us of host time per call on the H200."""
    calls = []

    def props(index):
        calls.append(index)
        return SimpleNamespace(major=9 if index == 0 else 8, multi_processor_count=132)

    monkeypatch.setattr(GPC, "DEVICE_PROPERTIES", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    for _ in range(3):
        assert GPC.sm90_or_newer(torch.device("cuda", 0))
        assert not GPC.sm90_or_newer(torch.device("cuda", 1))
        assert GPC.device_properties(torch.device("cuda", 0)).multi_processor_count == 132
    assert calls == [0, 1]


@pytest.mark.parametrize("room, stages", [(232_448, [4]), (163_840, [3]), (None, [3, 4])])
def test_tma_configs_keep_the_deepest_pipeline_that_fits(monkeypatch, room, stages):
    """Of the TMA configs that differ only in pipeline depth the autotuner times the deepest whose
    operand ring fits the GPU's shared memory (opt-in per block: 232,448 bytes on the H200); the
    pointer path's configs are left as they are."""
    props = SimpleNamespace() if room is None else SimpleNamespace(shared_memory_per_block_optin=room)
    monkeypatch.setattr(GPC, "INTERPRET", False)
    monkeypatch.setattr(GPC, "DEVICE_PROPERTIES", {0: props})
    base = SimpleNamespace(device=torch.device("cuda", 0), element_size=lambda: 2)
    configs = GPC.cuda_configs()
    tma = GPC.prune_configs(configs, {"x": SimpleNamespace(base=base)}, USE_TMA=True, BLOCK_N=128)
    assert all(c.kwargs["BIT_RANKS"] for c in tma)
    persistent = sorted(c.num_stages for c in tma if c.kwargs["PERSISTENT"] and c.kwargs["BLOCK_M"] == 256)
    assert persistent == stages
    if room is not None:
        assert all(GPC.operand_ring_bytes(c, 128, 2) + GPC.SMEM_SLACK <= room for c in tma)
    pointers = GPC.prune_configs(configs, {"x": torch.empty(1, 1)}, USE_TMA=False, BLOCK_N=128)
    assert pointers == [c for c in configs if not c.kwargs["BIT_RANKS"]]


@pytest.mark.parametrize("room, fits", [(232_448, True), (101_376, False), (None, True)])
def test_tma_path_only_where_a_config_fits(monkeypatch, room, fits):
    """GPUs of ~100 KiB of shared memory per block (sm120) fit no TMA config (the smallest ring is
    128 KiB at 16-bit inputs): the launcher takes the pointer path there, and an explicit
    ``use_tma=True`` names the limit. An unknown limit keeps TMA."""
    props = SimpleNamespace(major=12) if room is None else SimpleNamespace(major=12, shared_memory_per_block_optin=room)
    monkeypatch.setattr(GPC, "INTERPRET", False)
    monkeypatch.setattr(GPC, "DEVICE_PROPERTIES", {0: props})
    assert GPC.tma_fits(torch.device("cuda", 0), 2, 128) is fits
    assert GPC.tma_fits(torch.device("cpu"), 2, 128)  # off the GPU: the interpreter's choice stands
