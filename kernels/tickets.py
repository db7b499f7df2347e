"""Which program of a launch arrives last, and the call record it stores.

The programs of a launch never wait for each other, but each can take a ticket: an atomic add on a
zeroed int32 counter, whose old value tells a program whether it is the last of the launch to
arrive (``last_to_arrive``). The last one sees everything the others stored, so it finishes the
launch's work in the same launch: it sums split partials in a fixed order
(``dense_rows.scratch_product``, the weight-gradient kernel's hottest neurons), lists the flagged
rows (``row_lists.flag_rows``), or stores the call's record (``finish_call``).

``CallRecord``: where a counting kernel (``row_lists.flag_rows`` and ``dense_list``,
``sparse_ffn``'s guard, ``dense_act.dense_activation``) stores one call's telemetry, as fp64
values the host reads when it likes: calls, tokens, active entries, dense rows, a flag.

A launch leaves its tickets at zero (its last program takes them back), so a buffer of them is
zeroed once and then reused: ``zeroed_scratch(reuse=True)`` keeps one per device and stream, and
launches on one stream, which run one after another, each find it zeroed, with no fill (a PyTorch
fill costs the host about what a Triton launch does). Nothing synchronises the host; everything
can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton.language as tl

from .launch import capturing, raw_stream
from .triton_helpers import jit_helper


class CallRecord(NamedTuple):
    """Where a counting kernel stores one call's record: ``values`` fp64 ``[5]`` = (calls, tokens,
    active entries, dense rows, flag), updated to (calls + 1, M, Σ active, Σ dense, ``flag``) by the
    launch's last program; ``scratch`` int64 ``[3]`` (two sums and a ticket) is zero before and
    after each launch, so it is allocated once (zeroed) and reused, also under CUDA-graph replay."""

    values: torch.Tensor
    scratch: torch.Tensor
    flag: float


@jit_helper
def finish_call(values_ptr, scratch_ptr, active, dense, M, FLAG: tl.constexpr):
    """The end of each program of a counting launch (``CallRecord``): add this program's ``active``
    entries and ``dense`` rows (integer scalars) to ``scratch``; the last program to arrive (a
    ticket) stores the record and takes the sums and the ticket back to zero. Integer sums: exact
    in any order. Nothing is ever lost: the sums are moved out atomically and the ticket is
    decreased by the launch's size rather than overwritten, so two launches of one layer running
    at once on two streams share their counts between the records, and the next call starts clean.

    Only the ticket is acq_rel: one thread of the program issues all five atomics, so the ticket's
    release orders its two sums before it and its acquire orders the last program's exchanges
    after every other program's sums. Each acq_rel atomic compiles to a GPU-wide memory barrier
    and an L1 invalidation (sm90 SASS: one of each here, six with every atomic acq_rel)."""
    tl.atomic_add(scratch_ptr, active.to(tl.int64), sem="relaxed")
    tl.atomic_add(scratch_ptr + 1, dense.to(tl.int64), sem="relaxed")
    last = tl.num_programs(0) * tl.num_programs(1) - 1
    if tl.atomic_add(scratch_ptr + 2, 1, sem="acq_rel") == last:  # every other program's sums are in
        total_active = tl.atomic_xchg(scratch_ptr, 0, sem="relaxed")
        total_dense = tl.atomic_xchg(scratch_ptr + 1, 0, sem="relaxed")
        tl.atomic_add(scratch_ptr + 2, -(last + 1), sem="relaxed")
        tl.store(values_ptr, tl.load(values_ptr) + 1.0)
        tl.store(values_ptr + 1, M * tl.full([], 1.0, tl.float64))  # M may be a constexpr (1)
        tl.store(values_ptr + 2, total_active.to(tl.float64))
        tl.store(values_ptr + 3, total_dense.to(tl.float64))
        tl.store(values_ptr + 4, FLAG)


@jit_helper
def last_to_arrive(ticket_ptr, programs, RESET: tl.constexpr):
    """Whether this program is the last of ``programs`` to get here, through the zeroed int32
    ``ticket``; with ``RESET`` the last one sets it back to zero (``zeroed_scratch``). Everything
    every program stored before its call is visible to the last one: the CTA barrier orders its
    threads' stores before the ticket's release (``atomic_add`` is acq_rel at GPU scope), and the
    last program's acquire orders them before its loads. No program waits for another, so any
    grid size is safe."""
    tl.debug_barrier()
    last = tl.atomic_add(ticket_ptr, 1) == programs - 1
    if RESET:
        tl.atomic_xchg(ticket_ptr, 0, mask=last)
    return last


def check_record(record: CallRecord, device) -> None:
    if record.values.shape != (5,) or record.values.dtype != torch.float64 or record.values.device != device:
        raise ValueError(f"record.values must be float64 [5] on {device}")
    if record.scratch.shape != (3,) or record.scratch.dtype != torch.int64 or record.scratch.device != device:
        raise ValueError(f"record.scratch must be int64 [3] on {device}")


def record_without_kernel(record: CallRecord, m: int) -> None:
    """The record of a call whose counting kernel had nothing to launch (no rows or no columns)."""
    record.values[0] += 1
    record.values[1].fill_(float(m))
    record.values[2:4].zero_()
    record.values[4].fill_(record.flag)


# Zeroed int32 buffers kept per (device type, index, stream) for ``zeroed_scratch(reuse=True)``;
# the oldest is dropped past KEPT_TICKETS_STREAMS streams (code that makes a stream per batch).
KEPT_TICKETS: dict = {}
KEPT_TICKETS_MIN = 1024
KEPT_TICKETS_STREAMS = 64


def zeroed_scratch(n: int, device: torch.device, *, reuse: bool) -> torch.Tensor:
    """int32 zeros, at least ``n`` of them, for one launch's tickets and counters, which the launch
    leaves at zero again (``last_to_arrive`` resets its ticket).

    ``reuse``: one buffer per (device, stream), kept across calls. Launches on one stream run one
    after another, so each finds it zeroed and none pays a fresh fill (a PyTorch fill costs the
    host about what a Triton launch does). Not while a CUDA graph is captured, which records its
    own fill; callers pass ``reuse=False`` where a kept allocation is not allowed (the warm-up of
    CUDA-graph trees allocates from the graphs' pool). Two buffers for one launch need two
    regions of one call: each call may return the same buffer.
    """
    if reuse and not capturing(device):
        index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
        key = (device.type, index, raw_stream(index) if device.type == "cuda" else 0)
        buf = KEPT_TICKETS.get(key)
        if buf is None or buf.numel() < n:
            # A dropped buffer returns to the allocator on the stream it was made on (the key's),
            # which reuses it only after the work queued there: safe.
            buf = KEPT_TICKETS[key] = torch.zeros(max(n, KEPT_TICKETS_MIN), dtype=torch.int32, device=device)
            while len(KEPT_TICKETS) > KEPT_TICKETS_STREAMS:
                del KEPT_TICKETS[next(iter(KEPT_TICKETS))]
        return buf
    return torch.zeros(max(n, 1), dtype=torch.int32, device=device)
