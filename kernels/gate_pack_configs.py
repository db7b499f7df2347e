"""How ``gate_pack`` launches: its autotune configs, TMA or pointer loads, and its grid.

* ``autotune_configs``: the interpreter's one config, or the GPU's (``cuda_configs``), each a tile
  shape, pipeline depth and epilogue (``gate_pack``'s module docstring);
* ``prune_configs``: the configs a launch tries: bit-count ranks with TMA loads, the scan
  epilogue with pointers, and of TMA configs that differ only in their pipeline depth the deepest
  whose operand ring (``operand_ring_bytes``) fits the GPU's shared memory;
* ``tma_ok``, ``tma_fits``: whether a tensor's strides allow TMA descriptors, and whether some TMA
  config fits a GPU at all (the pointer path otherwise);
* ``persistent_programs``: the programs of a persistent launch, one per SM;
* ``device_properties``: ``torch.cuda.get_device_properties``, cached per device in
  ``DEVICE_PROPERTIES``.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .triton_helpers import INTERPRET


def set_tma_blocks(nargs) -> None:
    """Autotune pre-hook: the descriptors' block shapes follow the config's tile sizes."""
    if isinstance(nargs["x"], TensorDescriptor):
        nargs["x"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["w"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


def cuda_configs():
    # (BLOCK_M, BLOCK_K, warps, stages, EPI_SPLIT, PERSISTENT, BIT_RANKS); BLOCK_N is the format's
    # tile_n. Sweeps on the H200 (bf16, D=2048, H=5632, M=16384, cuBLAS gate GEMM 0.51-0.54 ms):
    # * persistent programs (one per SM, a flattened tile loop) overlap one tile's epilogue with
    #   the next tile's loads: 0.78 ms against 0.94 ms for the same scan-epilogue tile per program;
    # * bit-count ranks keep the epilogue in the accumulator's layout: 0.63-0.73 ms at 0.3-2%
    #   density for 256-row persistent tiles (0.64-0.68 with 4 stages), 0.74-0.79 for 128-row
    #   tiles one per program, against 0.84-0.88 for the scan epilogue's persistent tiles.
    # Per-tile programs with the scan epilogue stay for the pointer path (no TMA: pre-Hopper GPUs
    # and fp32, whose wider tiles need more shared memory than sm90 has).
    shapes = [(256, 64, 8, 3, 1, True, True), (256, 64, 8, 4, 1, True, True), (128, 64, 8, 4, 1, False, True),
              (128, 64, 8, 4, 2, False, False), (256, 64, 8, 3, 4, False, False), (64, 64, 4, 4, 2, False, False),
              (128, 32, 8, 3, 4, False, False)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "EPI_SPLIT": e, "PERSISTENT": p, "BIT_RANKS": r}, num_warps=w,
                      num_stages=s, pre_hook=set_tma_blocks)
        for bm, bk, w, s, e, p, r in shapes
    ]


def autotune_configs():
    if INTERPRET:  # one config: multi-config autotuning needs a GPU driver
        config = {"BLOCK_M": 32, "BLOCK_K": 32, "EPI_SPLIT": 1, "PERSISTENT": True, "BIT_RANKS": True}
        return [triton.Config(config, num_warps=4, num_stages=1, pre_hook=set_tma_blocks)]
    return cuda_configs()


# Shared memory a TMA config needs beyond its operand ring (barriers; 1,056 bytes on sm90).
SMEM_SLACK = 4096


def operand_ring_bytes(config, block_n: int, element_size: int) -> int:
    """Shared memory of a config's ring of x and w tiles: ``stages × (BLOCK_M + BLOCK_N) × BLOCK_K``
    elements (197,664 bytes in all for 256×128×64 tiles and 4 stages on sm90, bf16)."""
    kw = config.kwargs
    return config.num_stages * (kw["BLOCK_M"] + block_n) * kw["BLOCK_K"] * element_size


def tma_fits(device: torch.device, element_size: int, block_n: int) -> bool:
    """Whether some TMA config's operand ring fits ``device``'s opt-in shared memory per block. The
    smallest needs 128 KiB at 16-bit inputs: more than GPUs of ~100 KiB per block (sm120, the
    consumer Blackwell parts) have, which then take the pointer path. True when the limit is
    unknown, and off the GPU."""
    if INTERPRET or device.type != "cuda":
        return True
    room = getattr(device_properties(device), "shared_memory_per_block_optin", None)
    return room is None or _smallest_tma_ring(element_size, block_n) + SMEM_SLACK <= room


@functools.lru_cache(maxsize=None)
def _smallest_tma_ring(element_size: int, block_n: int) -> int:
    """The smallest operand ring of the TMA configs (cached: the launcher asks on every call)."""
    return min(operand_ring_bytes(c, block_n, element_size) for c in cuda_configs() if c.kwargs["BIT_RANKS"])


def prune_configs(configs, nargs, **kwargs):
    """With TMA loads: bit-count ranks, and of configs that differ only in their pipeline depth the
    deepest whose operand ring fits the GPU's shared memory. On the H200 (bf16, D=2048, H=5632,
    M=16384) the autotuner, timing warm back-to-back calls, picks 3 or 4 stages from run to run,
    while 3 stages run 0.02-0.03 ms slower a call in the bench's interleaved, flushed samples.
    Without TMA: the scan epilogue, one program per tile."""
    keep = [c for c in configs if c.kwargs["BIT_RANKS"] == kwargs["USE_TMA"]] or configs
    x = getattr(nargs.get("x"), "base", None)  # the TensorDescriptor's tensor
    if not kwargs["USE_TMA"] or INTERPRET or x is None:
        return keep
    room = getattr(device_properties(x.device), "shared_memory_per_block_optin", None)
    if room is None:
        return keep
    deepest = {}
    for c in keep:
        if operand_ring_bytes(c, kwargs["BLOCK_N"], x.element_size()) + SMEM_SLACK > room:
            continue
        shape = (c.num_warps, *sorted((k, v) for k, v in c.kwargs.items()))
        if shape not in deepest or c.num_stages > deepest[shape].num_stages:
            deepest[shape] = c
    return list(deepest.values()) or keep


def tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a unit last stride, 16-byte aligned rows and base, and a non-empty shape."""
    e = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * e) % 16 == 0 and t.data_ptr() % 16 == 0 and t.shape[1] > 0


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (three in the interpreter, to loop over tiles)."""
    if INTERPRET or device.type != "cuda":
        return 3
    return device_properties(device).multi_processor_count


def sm90_or_newer(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper or newer GPU."""
    return device_properties(device).major >= 9


# device index -> torch.cuda.get_device_properties(index), for device_properties
DEVICE_PROPERTIES: dict = {}


def device_properties(device: torch.device):
    """``torch.cuda.get_device_properties``, cached per device: the uncached query
    (``get_device_capability``) takes 5.5 us per call on the H200's host."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = DEVICE_PROPERTIES.get(index)
    if props is None:
        props = DEVICE_PROPERTIES.setdefault(index, torch.cuda.get_device_properties(index))
    return props
