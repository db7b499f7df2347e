"""Dense rows of the sparse kernels: which rows, their list, and their fp32 coefficients times
weights over H.

A few rows of a sparse batch are computed densely: rows with an overflowed tile, rows of the
finiteness guard. ``flag_rows`` finds the guard rows in one launch (row norms against bounds from
the weights, ``weights.guard_bounds``) and can add a call's counts to a telemetry buffer on the way,
and list the flagged rows on the device in its last program (``with_list``; ``dense_list`` does it
in a launch of its own). The forward (``sparse_ffn``) and the backward
(``sparse_ffn_backward``) first write those rows' per-neuron values (``h``; ``dgate`` and ``dup``)
into an fp32 scratch ``[planes, r_cap, H]``, one ``[16, BH]`` tile per program. This module turns
the scratch into rows of the output: ``dst[rows[i]] = Σ_planes coef[p, i, :] @ W_p (+ bias)``.

H is split over programs, then the last split of each output tile to finish sums the splits in a
fixed order (deterministic, one writer per output element). Before the split, the H200 took
milliseconds for a single dense row at D = 2048, H = 5632: a handful of programs each looped over
all of H (4.7 ms in the backward, 1.5 ms in the forward); split, it takes tens of microseconds.

It also holds the small helpers the kernel files share: ``jit_helper``, ``rowmajor``,
``reduce_sum``/``prefix_sum`` (interpreter-friendly reductions), ``dot`` and ``dot_split``, and
``CallRecord``/``finish_call``: a launch's counts stored as one call's record by its last program;
``last_to_arrive``: which program of a launch is the last (a ticket).

The lists and the split sums were launches of their own until session 21: on the H200 a training
step's host time measured the same without them (2.547 and 2.543 ms, in one process), since each
now needed a zeroed ticket, a fill as costly on the host as a Triton launch; an inference call's fell
from 0.601 to 0.576 ms, and each step has four fewer kernels (docs/benchmarks.md, session 21).
Since session 22 the tickets are left at zero by their launch and, in the ops, come from one kept
buffer per device and stream (``zeroed_scratch``), with no fill.

Everything runs on the device from ``n_dense`` (an int32 ``[1]`` tensor): no host sync, CUDA-graph
capturable. List positions past ``n_dense`` cost one early return per program.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .checks import check_tensor
from .launch import capturing, cdiv, launch, next_power_of_2, raw_stream

# Set before import (DESIGN.md section 9): the interpreter computes bf16 tl.dot wrongly.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Rows per dense tile: the smallest tl.dot M dimension on tensor cores.
BR = 16
# Scratch budget of each launcher's dense rows (fp32 values of the first r_cap list positions);
# rows past it take that launcher's blocked kernels.
SCRATCH_BYTES = 32 << 20
# The scratch also holds at least this fraction of a call's rows, the most that the dispatch
# (lowering.cuda_impl.SPARSE_MAX_DENSE_ROWS) lets the sparse path compute densely: rows past the
# scratch are slow, above all in the backward (on the H200, 16 rows past it cost a training step
# ~3.4 ms, session 15).
DENSE_ROW_FRACTION_MAX = 0.02
# Row blocks in the grids of the kernels for list positions past the scratch, which loop over the
# rest: a program per block of M - r_cap rows, nearly all returning at once, cost the H200 18 us
# of a training step (16 thousand programs; session 19). Two in the interpreter, so the CPU tests
# run the loop.
BLOCKED_ROW_PROGRAMS = 2 if INTERPRET else 128


def scratch_capacity(m: int, bytes_per_row: int, requested: Optional[int] = None) -> int:
    """``r_cap``: the dense-row list positions given scratch, a multiple of ``BR`` and at most
    ``m`` rounded up to one: ``requested`` (tests), else ``SCRATCH_BYTES`` worth and at least
    ``DENSE_ROW_FRACTION_MAX`` of the rows."""
    m_pad = cdiv(m, BR) * BR
    if requested is not None:
        return min(m_pad, cdiv(requested, BR) * BR)
    budget = max(BR, SCRATCH_BYTES // bytes_per_row // BR * BR)
    return min(m_pad, max(budget, cdiv(math.ceil(DENSE_ROW_FRACTION_MAX * m), BR) * BR))


def jit_helper(fn):
    """``triton.jit`` for device helpers; a plain function under the interpreter, which re-patches
    ``triton.language`` on every call of a jit function (about 2 ms each, most of the CPU test
    time) while a plain function runs inside the kernel's already patched scope."""
    return fn if INTERPRET else triton.jit(fn)


if INTERPRET:
    # tl.sum and tl.cumsum are jit functions too: call the reduction they wrap directly. (Kernels
    # use tl.full, a builtin, rather than the jit tl.zeros for the same reason.)
    def reduce_sum(x, axis):
        return tl.reduce(x, axis, tl.standard._sum_combine)

    def prefix_sum(x, axis):
        return tl.associative_scan(x, axis, tl.standard._sum_combine)

else:

    @triton.jit
    def reduce_sum(x, axis: tl.constexpr):
        return tl.sum(x, axis=axis)

    @triton.jit
    def prefix_sum(x, axis: tl.constexpr):
        return tl.cumsum(x, axis=axis)


@jit_helper
def column_mask(offs, D, EVEN: tl.constexpr):
    """``offs < D``, or a constant all-true mask when ``EVEN`` (D a multiple of the block). A mask
    the compiler cannot fold keeps a predicate per element: at D = 2048 on sm90 the pair loop of
    ``sparse_ffn`` needed 112 registers a thread against 64 without it, and so fewer programs per SM."""
    if EVEN:
        return tl.full(offs.shape, 1, tl.int1)
    else:
        return offs < D


class CallRecord(NamedTuple):
    """Where a counting kernel stores one call's record: ``values`` fp64 ``[5]`` = (calls, tokens,
    active entries, dense rows, flag), updated to (calls + 1, M, Σ active, Σ dense, ``flag``) by the
    launch's last program; ``scratch`` int64 ``[3]`` (two sums and a ticket) is zero before and
    after each launch, so it is allocated once (zeroed) and reused, also under CUDA-graph replay."""

    values: torch.Tensor
    scratch: torch.Tensor
    flag: float


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
    and an L1 invalidation (sm90 SASS: 6 of each with every atomic acq_rel, 1 now)."""
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


def rowmajor(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dimension (a copy only when it is not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


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


# Zeroed int32 buffers kept per (device type, index, stream) for ``zeroed_scratch(reuse=True)``;
# the oldest is dropped past _TICKETS_STREAMS streams (code that makes a stream per batch).
_TICKETS: dict = {}
_TICKETS_MIN = 1024
_TICKETS_STREAMS = 64


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
        buf = _TICKETS.get(key)
        if buf is None or buf.numel() < n:
            # A dropped buffer returns to the allocator on the stream it was made on (the key's),
            # which reuses it only after the work queued there: safe.
            buf = _TICKETS[key] = torch.zeros(max(n, _TICKETS_MIN), dtype=torch.int32, device=device)
            while len(_TICKETS) > _TICKETS_STREAMS:
                del _TICKETS[next(iter(_TICKETS))]
        return buf
    return torch.zeros(max(n, 1), dtype=torch.int32, device=device)


@triton.jit
def _dense_list_kernel(flags_ptr, rows_ptr, ndense_ptr, rowcnt_ptr, values_ptr, scratch_ptr, M,
                       BLOCK: tl.constexpr, RECORD: tl.constexpr = False, FLAG: tl.constexpr = 0.0):
    """One program: ``rows[0:n]`` = the rows with ``flags != 0`` in increasing order, ``ndense = n``.
    ``BLOCK`` flags per step, ranked by a prefix sum on top of the running count. With RECORD, the
    call's record (``finish_call``) from the flagged rows and the rows' active counts ``rowcnt``.

    One reduction a step (the block's flag count; most blocks flag nothing, so most skip the scan),
    the active counts summed lane by lane and reduced once at the end, and the next block's loads
    issued while this one is reduced (``num_stages=2``): the steps were three dependent reductions
    each, and the kernel's time is its serial latency."""
    offs = tl.arange(0, BLOCK)
    count = tl.program_id(0) * 0  # int32 running count
    active = tl.full((BLOCK,), 0, tl.int64)
    for start in tl.range(0, M, BLOCK, num_stages=2):
        r = start + offs
        f = (tl.load(flags_ptr + r, mask=r < M, other=0) != 0).to(tl.int32)
        if RECORD:
            active += tl.load(rowcnt_ptr + r, mask=r < M, other=0).to(tl.int64)
        n = tl.sum(f, axis=0)
        if n > 0:
            pos = count + tl.cumsum(f, axis=0) - f
            tl.store(rows_ptr + pos, r, mask=f != 0)
            count += n
    tl.store(ndense_ptr, count)
    if RECORD:
        finish_call(values_ptr, scratch_ptr, tl.sum(active, axis=0), count, M, FLAG)


@jit_helper
def _list_blocks(flags_ptr, blk_ptr, rows_ptr, ndense_ptr, M, N_BLK, BR: tl.constexpr, CB: tl.constexpr,
                 SUB: tl.constexpr):
    """``_dense_list_kernel``'s list, in the last program of ``_flag_rows_kernel``, from the flags
    and the flagged rows per ``BR``-row block (``blk``) its programs stored. ``CB`` block counts
    are read per step and the flags only of ``SUB`` blocks with a flagged row, so that with none (the
    usual case) the serial work is one load per ``CB · BR`` rows, and the registers stay those of
    ``SUB · BR`` flags (a 4096-flag scan took the kernel from 40 to 128 registers)."""
    offs_b = tl.arange(0, CB)
    offs_r = tl.arange(0, SUB * BR)
    count = tl.program_id(0) * 0  # int32 running count
    for b0 in range(0, N_BLK, CB):
        c = tl.load(blk_ptr + b0 + offs_b, mask=b0 + offs_b < N_BLK, other=0, cache_modifier=".cg")
        if tl.max(c, axis=0) > 0:
            for s0 in range(0, CB, SUB):
                if tl.max(tl.where((offs_b >= s0) & (offs_b < s0 + SUB), c, 0), axis=0) > 0:
                    r = (b0 + s0) * BR + offs_r
                    f = (tl.load(flags_ptr + r, mask=r < M, other=0, cache_modifier=".cg") != 0).to(tl.int32)
                    pos = count + prefix_sum(f, 0) - f
                    tl.store(rows_ptr + pos, r, mask=f != 0)
                    count += reduce_sum(f, 0)
    tl.store(ndense_ptr, count)


class RowList(NamedTuple):
    """Flagged rows listed on the device: int32 ``rows [M]`` in increasing order (entries past
    ``n_dense`` unspecified) and their int32 ``[1]`` count ``n_dense``."""

    rows: torch.Tensor
    n_dense: torch.Tensor


def _empty_list(m: int, device) -> RowList:
    return RowList(torch.empty(max(m, 1), dtype=torch.int32, device=device),
                   torch.empty(1, dtype=torch.int32, device=device))


def dense_list(flags: torch.Tensor, record: Optional[CallRecord] = None,
               row_counts: Optional[torch.Tensor] = None) -> RowList:
    """``RowList`` of the rows flagged in bool ``flags [M]``. One launch, no host sync (it replaced
    six tensor ops whose launches cost more host time than their work); ``flag_rows(...,
    with_list=True)`` makes it on the way instead. ``record`` (with int32 ``row_counts [M]``, each
    row's active entries) receives the call's record: ``Σ row_counts`` and the flagged rows."""
    if (record is None) != (row_counts is None):
        raise ValueError("dense_list: pass record and row_counts together")
    m = flags.shape[0]
    out = _empty_list(m, flags.device)
    if record is not None:
        check_record(record, flags.device)
        check_tensor("row_counts", row_counts, (m,), (torch.int32,), flags.device)
        if m == 0:
            record_without_kernel(record, m)
            out.n_dense.zero_()
            return out
    f = flags.contiguous().view(torch.uint8)
    meta = (record.values, record.scratch) if record is not None else (out.n_dense, out.n_dense)
    launch(_dense_list_kernel, (1,), f, out.rows, out.n_dense, f if row_counts is None else row_counts.contiguous(),
           *meta, m, BLOCK=_LIST_BLOCK, RECORD=record is not None,
           FLAG=0.0 if record is None else float(record.flag), num_warps=8)
    return out


# Flags per step of dense_list's scan; flag_rows' list: block counts per step, blocks per scan.
_LIST_BLOCK = 256 if INTERPRET else 4096
_LIST_BLOCKS, _LIST_SUB = (8, 2) if INTERPRET else (256, 16)


@jit_helper
def _norm_exceeds(t_ptr, bound_ptr, rows, r_ok, D, stride, BR: tl.constexpr, BK: tl.constexpr):
    """bool ``[BR]``: not ``‖t[row]‖·bound[0] + bound[1] < bound[2]`` (fp32 norm; NaN flags)."""
    offs_k = tl.arange(0, BK)
    sq = tl.full((BR,), 0.0, tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + offs_k
        v = tl.load(t_ptr + rows[:, None] * stride + kk[None, :], mask=r_ok[:, None] & (kk < D)[None, :], other=0.0)
        v = v.to(tl.float32)
        sq += tl.sum(v * v, axis=1)
    bound = tl.sqrt_rn(sq) * tl.load(bound_ptr) + tl.load(bound_ptr + 1)
    return (bound < tl.load(bound_ptr + 2)) == 0


@triton.jit
def _flag_rows_kernel(
    # pointers
    a_ptr, a_bound_ptr, b_ptr, b_bound_ptr, count_ptr, flags_ptr, values_ptr, scratch_ptr,
    ticket_ptr, blk_ptr, list_ptr, ndense_ptr,
    # dimensions, row strides (elements)
    M, D, N_TILES, stride_a, stride_b,
    # meta-parameters
    HAS_B: tl.constexpr, HAS_COUNT: tl.constexpr, FLAG_OVERFLOW: tl.constexpr, RECORD: tl.constexpr,
    MARK: tl.constexpr, LIST: tl.constexpr, FLAG: tl.constexpr, SLOTS: tl.constexpr, NT_P2: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr, CB: tl.constexpr, SUB: tl.constexpr,
):
    """``flag_rows`` for rows ``BR·pid ...``: norm tests of ``a`` (and ``b``), overflowed tiles of
    ``count``, this block's share of the call's record (``finish_call``), and with ``MARK`` the
    flagged rows with no overflowed tile marked overflowed (``count[r, 0] = SLOTS + 1``). With
    ``LIST`` the last program to finish (``ticket``, zeroed, and left zeroed) lists every flagged
    row (``_list_blocks``, from each program's count of them in ``blk [pid]``, which every program
    stores: never zeroed)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = r < M
    rows = r.to(tl.int64)
    flag = _norm_exceeds(a_ptr, a_bound_ptr, rows, r_ok, D, stride_a, BR, BK)
    if HAS_B:
        flag = flag | _norm_exceeds(b_ptr, b_bound_ptr, rows, r_ok, D, stride_b, BR, BK)
    if HAS_COUNT:
        tiles = tl.arange(0, NT_P2)
        cnt = tl.load(count_ptr + rows[:, None] * N_TILES + tiles[None, :],
                      mask=r_ok[:, None] & (tiles < N_TILES)[None, :], other=0)
        over = tl.max(cnt, axis=1) > SLOTS
        dense = flag | over
        if RECORD:  # the counts as read, before any mark
            finish_call(values_ptr, scratch_ptr, tl.sum(tl.sum(cnt, axis=1), axis=0),
                        tl.sum((dense & r_ok).to(tl.int32), axis=0), M, FLAG)
        if MARK:
            tl.store(count_ptr + rows * N_TILES, tl.full((BR,), SLOTS + 1, tl.int32), mask=r_ok & flag & (over == 0))
        if FLAG_OVERFLOW:
            flag = dense
    tl.store(flags_ptr + rows, flag.to(tl.uint8), mask=r_ok)
    if LIST:
        tl.store(blk_ptr + tl.program_id(0), tl.sum((flag & r_ok).to(tl.int32), axis=0))
        if last_to_arrive(ticket_ptr, tl.num_programs(0), True):
            _list_blocks(flags_ptr, blk_ptr, list_ptr, ndense_ptr, M, tl.num_programs(0), BR, CB, SUB)


def flag_rows(a: torch.Tensor, a_bound: torch.Tensor, b: Optional[torch.Tensor] = None,
              b_bound: Optional[torch.Tensor] = None, count: Optional[torch.Tensor] = None, *, slots: int = 0,
              flag_overflow: bool = False, record: Optional[CallRecord] = None, mark: bool = False,
              with_list: bool = False, reuse_tickets: bool = False):
    """bool ``[M]``: the rows to compute densely, in one launch (``reference.flag_rows_ref``).

    A row is flagged unless ``‖a[r]‖·a_bound[0] + a_bound[1] < a_bound[2]`` (fp32 norm; NaN and
    Inf flag), the same for ``b`` with ``b_bound``, and, with ``flag_overflow``, when one of its
    ``count [M, n_tiles]`` entries exceeds ``slots``. ``record`` (with ``count``) receives the
    call's record (``CallRecord``): ``Σ count`` active entries and the rows flagged or overflowed,
    with no extra launch. ``mark`` (with ``count``): each flagged row with no overflowed tile gets
    ``count[r, 0] = slots + 1`` in place, so that whatever reads the counts next (the sparse
    kernels, a backward) computes it densely as an overflowed row, with no flags to carry.
    ``with_list``: return ``(flags, RowList)``, the list made by the launch's last program
    (``dense_list``'s, without its launch), with ``reuse_tickets`` its ticket from a kept buffer
    (``zeroed_scratch``). Bounds are fp32 ``[3]`` device tensors; no host sync.
    """
    if (b is None) != (b_bound is None):
        raise ValueError("flag_rows: pass b and b_bound together")
    if (record is not None or mark) and count is None:
        raise ValueError("flag_rows: a record and marks need count")
    if mark and not count.is_contiguous():
        raise ValueError("flag_rows: count must be contiguous to be marked in place")
    m, d = a.shape
    flags = torch.empty(m, dtype=torch.bool, device=a.device)
    if record is not None:
        check_record(record, a.device)
    listed = _empty_list(m, a.device) if with_list else None
    if m == 0:
        if record is not None:
            record_without_kernel(record, m)
        if with_list:
            listed.n_dense.zero_()
        return (flags, listed) if with_list else flags
    a = rowmajor(a)
    b = a if b is None else rowmajor(b)
    n_tiles = 0 if count is None else count.shape[1]
    cnt = a_bound if count is None else count.contiguous()
    br = 16
    programs = cdiv(m, br)
    # the ticket (zeroed) and each program's count of flagged rows (stored by every program)
    ticket = zeroed_scratch(1, a.device, reuse=reuse_tickets) if with_list else None
    blk = torch.empty(programs, dtype=torch.int32, device=a.device) if with_list else None
    launch(_flag_rows_kernel, (programs,),
        a, a_bound, b, a_bound if b_bound is None else b_bound, cnt, flags.view(torch.uint8),
        a_bound if record is None else record.values, a_bound if record is None else record.scratch,
        *((ticket, blk, *listed) if with_list else (a_bound,) * 4),
        m, d, n_tiles, a.stride(0), b.stride(0),
        HAS_B=b_bound is not None, HAS_COUNT=count is not None, FLAG_OVERFLOW=flag_overflow,
        RECORD=record is not None, MARK=mark, LIST=with_list, FLAG=0.0 if record is None else float(record.flag),
        SLOTS=slots, NT_P2=max(2, next_power_of_2(n_tiles)), BR=br, BK=min(256, max(16, next_power_of_2(d))),
        CB=_LIST_BLOCKS, SUB=_LIST_SUB, num_warps=4,
    )
    return (flags, listed) if with_list else flags


@jit_helper
def dot(a, b, acc, NATIVE: tl.constexpr):
    """``acc + a @ b``: tensor cores on 16-bit operands (exact products, fp32 sums), else IEEE fp32
    (also under the interpreter, whose bf16 tl.dot is wrong)."""
    if NATIVE:
        acc = tl.dot(a, b, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@jit_helper
def dot_split(c, w, acc, SPLIT: tl.constexpr, NATIVE: tl.constexpr):
    """``acc + c @ w`` for fp32 ``c`` and 16/32-bit ``w``.

    SPLIT: ``c = hi + lo``, both in w's dtype, through two ``dot`` products (on tensor cores when
    NATIVE: about 16 bits of ``c``, where one product would round it to w's 8 or 11); ``lo`` is 0
    where ``c`` is ±Inf or NaN. The caller makes sure ``hi`` cannot overflow w's dtype where ``c``
    is finite. Otherwise IEEE fp32 products.
    """
    if SPLIT:
        hi = c.to(w.dtype)
        lo = tl.where(tl.abs(c) < float("inf"), c - hi.to(tl.float32), 0.0).to(w.dtype)
        acc = dot(hi, w, acc, NATIVE)
        acc = dot(lo, w, acc, NATIVE)
    else:
        acc = dot(c, w, acc, False)
    return acc


@triton.jit
def _split_product_kernel(
    # pointers (w2, plane 1: read only when TWO)
    coef_ptr, w1_ptr, w2_ptr, rows_ptr, ndense_ptr, part_ptr, tickets_ptr, bias_ptr, dst_ptr,
    # dimensions (PLANE = R_CAP · H; H_PER: the H columns of one split)
    D, H, R_CAP, PLANE, H_PER,
    # row strides (elements)
    stride_w1, stride_w2, stride_dst,
    # meta-parameters
    TWO: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr,
    BH: tl.constexpr, BD: tl.constexpr,
):
    """``part[s, i, dblock] = Σ_{j in split s} coef[0, i, j] · W1[j, dblock] (+ coef[1, i, j] ·
    W2[j, dblock])`` for the ``BR`` list positions ``i < n_dense`` of this program; the last split
    of each ``(i, dblock)`` tile to finish (a ticket per tile) then writes ``dst[rows[i], dblock] =
    Σ_s part[s, i, dblock] (+ bias)``, summed in split order (deterministic, one rounding)."""
    i0 = tl.program_id(0) * BR
    n_dense = tl.load(ndense_ptr)
    if i0 < n_dense:
        i = i0 + tl.arange(0, BR)
        r_ok = i < n_dense
        offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
        d_ok = offs_d < D
        h_lo = tl.program_id(2) * H_PER
        h_hi = tl.minimum(H, h_lo + H_PER)
        acc = tl.full((BR, BD), 0.0, tl.float32)
        for h0 in range(h_lo, h_hi, BH):
            hc = h0 + tl.arange(0, BH)
            h_ok = hc < h_hi
            hc = hc.to(tl.int64)
            at = i.to(tl.int64)[:, None] * H + hc[None, :]
            ok = r_ok[:, None] & h_ok[None, :]
            w_mask = h_ok[:, None] & d_ok[None, :]
            c1 = tl.load(coef_ptr + at, mask=ok, other=0.0)
            w1 = tl.load(w1_ptr + hc[:, None] * stride_w1 + offs_d[None, :], mask=w_mask, other=0.0)
            acc = dot_split(c1, w1, acc, SPLIT, NATIVE)
            if TWO:
                c2 = tl.load(coef_ptr + PLANE + at, mask=ok, other=0.0)
                w2 = tl.load(w2_ptr + hc[:, None] * stride_w2 + offs_d[None, :], mask=w_mask, other=0.0)
                acc = dot_split(c2, w2, acc, SPLIT, NATIVE)
        ok = r_ok[:, None] & d_ok[None, :]
        at = i.to(tl.int64)[:, None] * D + offs_d[None, :]
        tl.store(part_ptr + tl.program_id(2).to(tl.int64) * R_CAP * D + at, acc, mask=ok)
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if last_to_arrive(tickets_ptr + tile, tl.num_programs(2), True):
            acc = tl.full((BR, BD), 0.0, tl.float32)
            for s in range(tl.num_programs(2)):
                acc += tl.load(part_ptr + s * R_CAP * D + at, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            rows = tl.load(rows_ptr + i, mask=r_ok, other=0).to(tl.int64)
            tl.store(dst_ptr + rows[:, None] * stride_dst + offs_d[None, :], acc.to(dst_ptr.dtype.element_ty), mask=ok)


def split_count(h: int, bh: int) -> int:
    """H splits of ``scratch_product``: about 8 ``bh`` blocks per program, at most 16 splits."""
    return max(1, min(16, cdiv(h, 8 * bh)))


def scratch_product(coef: torch.Tensor, rows: torch.Tensor, n_dense: torch.Tensor, weights, dst: torch.Tensor,
                    bias=None, *, split: bool, bh: int, bd: int, warps: int, reuse_tickets: bool = False) -> None:
    """``dst[rows[i]] = Σ_p coef[p, i] @ weights[p] (+ bias)`` for list positions ``i < n_dense``.

    ``coef``: fp32 ``[planes, r_cap, H]`` (``r_cap`` a multiple of ``BR``; planes past
    ``len(weights)`` are not read); ``weights``: one or two ``[H, D]`` tensors with a contiguous
    last dimension; ``dst``: ``[M, D]``, rows not in the list are left alone; ``split``: the
    ``hi + lo`` products of ``dot_split``. One launch: each output tile's last split sums the
    splits. Temporaries: fp32 ``[split_count, r_cap, D]`` and an int32 ticket per output tile
    (``zeroed_scratch``, kept with ``reuse_tickets``).
    """
    r_cap, h = coef.shape[1], coef.shape[2]
    d = weights[0].shape[1]
    n_split = split_count(h, bh)
    h_per = cdiv(cdiv(h, n_split), bh) * bh
    n_split = cdiv(h, h_per)
    part = torch.empty(n_split, r_cap, d, dtype=torch.float32, device=coef.device)
    grid = (r_cap // BR, cdiv(d, bd), n_split)
    tickets = zeroed_scratch(grid[0] * grid[1], coef.device, reuse=reuse_tickets)
    w1, w2 = weights[0], weights[-1]
    launch(_split_product_kernel, grid,
        coef, w1, w2, rows, n_dense, part, tickets, bias if bias is not None else part, dst,
        d, h, r_cap, r_cap * h, h_per, w1.stride(0), w2.stride(0), dst.stride(0),
        TWO=len(weights) == 2, SPLIT=split, NATIVE=not INTERPRET, HAS_BIAS=bias is not None, BR=BR, BH=bh, BD=bd,
        num_warps=warps,
    )
