"""The neurons a TwELL buffer holds an entry of, stamped on the device in one launch.

Dead-neuron telemetry keeps, per neuron, the sampled-token count at its last firing. A sampled
training call stamps every neuron that fired in it: each neuron of a stored slot
(``s < min(count, slots)``) and, since an overflowed tile row keeps only its first entries, every
neuron of a tile that overflowed in some row (so a dead neuron is never overcounted). That is
``reference.fired_neurons``; ``stamp_fired`` writes the same stamps from the buffer directly.

Why a kernel: the same thing in tensor ops scatters one bool per slot, most of them into one
"not stored" address. On the H200 that ``scatter_`` took 104 µs of a 768-wide layer's sampled
call (~165 µs with the ops around it, docs/benchmarks.md), by contention on that one address.
Here a slot that is not stored writes nothing, and all writes of a call store the same value, so
their order does not matter.

Bytes: the counts and the stored slots' columns, ``M·n_tiles·4`` plus at most ``M·n_tiles·slots·4``,
and one 8-byte store per stored slot (fewer where they coincide in cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .format import DEFAULT_LAYOUT, TwellLayout, TwellPacked
from .launch import cdiv, launch, next_power_of_2

# Token rows per program (one TwELL tile each): 64 × 16 slots is one 4 KB read of columns.
STAMP_ROWS = 64


# Every argument unspecialized (no divisibility, alignment or ==1 variants): one binary serves every
# call, so ``warm_stamp_fired`` compiles it before any CUDA-graph capture could have to.
_INTS = ("M", "N_TILES", "H", "stride_im", "stride_it", "stride_is", "stride_cm", "stride_ct")
_POINTERS = ("idx_ptr", "count_ptr", "stamps_ptr", "now_ptr")


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _stamp_fired_kernel(idx_ptr, count_ptr, stamps_ptr, now_ptr, M, N_TILES, H,
                        stride_im, stride_it, stride_is, stride_cm, stride_ct,
                        SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, TILE_N: tl.constexpr, TB: tl.constexpr):
    """``stamps[j] = now[0]`` for every neuron ``j`` that ``TB`` rows of tile ``program_id(1)``
    hold a stored slot of, and for the whole tile if one of those rows overflowed it."""
    b = tl.program_id(0)
    tau = tl.program_id(1)
    rows = b * TB + tl.arange(0, TB)
    r_ok = rows < M
    rows64 = rows.to(tl.int64)
    cnt = tl.load(count_ptr + rows64 * stride_cm + tau * stride_ct, mask=r_ok, other=0)
    now = tl.load(now_ptr)
    s = tl.arange(0, SLOTS_P2)
    stored = r_ok[:, None] & (s[None, :] < tl.minimum(cnt, SLOTS)[:, None])  # [TB, SLOTS_P2]
    at = rows64[:, None] * stride_im + tau * stride_it + s[None, :] * stride_is
    col = tl.load(idx_ptr + at, mask=stored, other=0)
    ok = stored & (col >= 0) & (col < H)  # a stored column is always in range; never write outside
    tl.store(stamps_ptr + col, tl.broadcast_to(now, (TB, SLOTS_P2)), mask=ok)
    if tl.max((cnt > SLOTS).to(tl.int32), axis=0) > 0:
        cols = tau * TILE_N + tl.arange(0, TILE_N)
        tl.store(stamps_ptr + cols, tl.broadcast_to(now, (TILE_N,)), mask=cols < H)


def stamp_fired(packed: TwellPacked, stamps: torch.Tensor, now: torch.Tensor, *,
                layout: TwellLayout = DEFAULT_LAYOUT) -> None:
    """Set ``stamps[j] = now`` for every neuron ``j`` that fired by ``packed``'s account
    (``reference.fired_neurons``): one launch, no host synchronisation. ``stamps`` is a contiguous
    ``[H]`` tensor and ``now`` a one-element tensor of its dtype, both on ``packed``'s device;
    ``packed`` may be paired or not."""
    m, n_tiles = packed.count.shape
    hidden = stamps.numel()
    if packed.idx.shape != (m, n_tiles, layout.slots) or n_tiles != layout.n_tiles(hidden):
        raise ValueError(f"stamp_fired: a TwELL buffer of idx {tuple(packed.idx.shape)} and count "
                         f"{tuple(packed.count.shape)} does not cover {hidden} neurons in tiles of "
                         f"{layout.tile_n} columns and {layout.slots} slots")
    if not stamps.is_contiguous() or now.numel() != 1 or now.dtype != stamps.dtype:
        raise ValueError(f"stamp_fired: stamps must be contiguous and now one {stamps.dtype} value, got stamps "
                         f"{tuple(stamps.shape)} strides {stamps.stride()} and now {tuple(now.shape)} {now.dtype}")
    if m == 0 or n_tiles == 0:
        return
    idx, count = packed.idx, packed.count
    launch(_stamp_fired_kernel, (cdiv(m, STAMP_ROWS), n_tiles), idx, count, stamps, now, m, n_tiles, hidden,
           *idx.stride(), *count.stride(), SLOTS=layout.slots, SLOTS_P2=next_power_of_2(layout.slots),
           TILE_N=layout.tile_n, TB=STAMP_ROWS, num_warps=4)


_warm_devices: set = set()


def warm_stamp_fired(device, *, layout: TwellLayout = DEFAULT_LAYOUT) -> None:
    """Compile and load ``stamp_fired``'s binary on ``device`` now, by a launch on a one-row buffer
    (once per device and layout): a sampled call inside a CUDA-graph capture then finds it ready,
    as a capture cannot compile or load a kernel."""
    device = torch.device(device)
    key = (device, layout)
    if key in _warm_devices:
        return
    # Launches go to the current device: at rewrite time that need not be the layer's.
    with torch.cuda.device(device):
        packed = TwellPacked(idx=torch.zeros(1, 1, layout.slots, dtype=torch.int32, device=device),
                             val=torch.zeros(1, 1, layout.slots, dtype=torch.float32, device=device),
                             count=torch.zeros(1, 1, dtype=torch.int32, device=device))
        stamp_fired(packed, torch.zeros(layout.tile_n, dtype=torch.float64, device=device),
                    torch.zeros(1, dtype=torch.float64, device=device), layout=layout)
    _warm_devices.add(key)


KERNELS = {"stamp_fired": _stamp_fired_kernel}
