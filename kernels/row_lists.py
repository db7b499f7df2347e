"""The rows a sparse call computes densely, flagged and listed on the device.

A few rows of a sparse batch are computed densely, so that the result stays exact
(docs/architecture.md, 'Exactness contract'): rows with an overflowed tile, and the rows of the
finiteness guard. ``flag_rows`` finds the guard rows in one launch, from each row's fp32 norm and
bounds made from the weights (``weights.guard_bounds``): row ``r`` is flagged unless
``‖a[r]‖·bound[0] + bound[1] < bound[2]``. On the way it can store the call's record
(``tickets.CallRecord``), mark the flagged rows as overflowed in the TwELL counts, and list the
flagged rows in its last program (``with_list``). ``dense_list`` lists the rows of a bool tensor
in a launch of its own.

A ``RowList`` is int32 ``rows [M]`` (increasing) and its int32 ``[1]`` count ``n_dense``, both on the
device: the dense-row kernels read ``n_dense`` there, and list positions past it cost one early
return per program, so nothing synchronises the host.

Bytes: ``flag_rows`` reads each row of ``a`` (and ``b``) once, ``M·D·e``, and the counts,
``M·n_tiles·4``, and writes ``M`` bytes of flags, with ``with_list`` one int32 per 16 rows and one
per listed row; ``dense_list`` reads the ``M`` flags (and ``4·M`` row counts with a record). The
list made by ``flag_rows``' last program instead of a launch of its own: on the H200 an inference
call's host time 0.576 ms against 0.601 ms (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .checks import check_tensor
from .launch import cdiv, launch, next_power_of_2
from .tickets import CallRecord, check_record, finish_call, last_to_arrive, record_without_kernel, zeroed_scratch
from .triton_helpers import INTERPRET, jit_helper, prefix_sum, reduce_sum, rowmajor


# Flags per step of dense_list's scan; flag_rows' list: block counts per step, blocks per scan.
_LIST_BLOCK = 256 if INTERPRET else 4096
LIST_BLOCKS, LIST_SUB = (8, 2) if INTERPRET else (256, 16)


class RowList(NamedTuple):
    """Flagged rows listed on the device: int32 ``rows [M]`` in increasing order (entries past
    ``n_dense`` unspecified) and their int32 ``[1]`` count ``n_dense``."""

    rows: torch.Tensor
    n_dense: torch.Tensor


@triton.jit
def _dense_list_kernel(flags_ptr, rows_ptr, ndense_ptr, rowcnt_ptr, values_ptr, scratch_ptr, M,
                       BLOCK: tl.constexpr, RECORD: tl.constexpr = False, FLAG: tl.constexpr = 0.0):
    """One program: ``rows[0:n]`` = the rows with ``flags != 0`` in increasing order, ``ndense = n``.
    ``BLOCK`` flags per step, ranked by a prefix sum on top of the running count. With RECORD, the
    call's record (``finish_call``) from the flagged rows and the rows' active counts ``rowcnt``.

    One reduction a step (the block's flag count; most blocks flag nothing, so most skip the scan),
    the active counts summed lane by lane and reduced once at the end, and the next block's loads
    issued while this one is reduced (``num_stages=2``): the kernel's time is its serial latency."""
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


def _empty_list(m: int, device) -> RowList:
    return RowList(torch.empty(max(m, 1), dtype=torch.int32, device=device),
                   torch.empty(1, dtype=torch.int32, device=device))


def dense_list(flags: torch.Tensor, record: Optional[CallRecord] = None,
               row_counts: Optional[torch.Tensor] = None, *, check: bool = True) -> RowList:
    """``RowList`` of the rows flagged in bool ``flags [M]``. One launch, no host sync (in tensor ops it
    takes six, whose launches cost more host time than their work); ``flag_rows(...,
    with_list=True)`` makes it on the way instead. ``record`` (with int32 ``row_counts [M]``, each
    row's active entries) receives the call's record: ``Σ row_counts`` and the flagged rows.
    ``check=False``: the caller has checked the arguments."""
    if (record is None) != (row_counts is None):
        raise ValueError("dense_list: pass record and row_counts together")
    m = flags.shape[0]
    out = _empty_list(m, flags.device)
    if record is not None:
        if check:
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


def flag_rows(a: torch.Tensor, a_bound: torch.Tensor, b: Optional[torch.Tensor] = None,
              b_bound: Optional[torch.Tensor] = None, count: Optional[torch.Tensor] = None, *, slots: int = 0,
              flag_overflow: bool = False, record: Optional[CallRecord] = None, mark: bool = False,
              with_list: bool = False, reuse_tickets: bool = False, check: bool = True):
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
    (``zeroed_scratch``). Bounds are fp32 ``[3]`` device tensors; no host sync. ``check=False``:
    the caller has checked the arguments.
    """
    if (b is None) != (b_bound is None):
        raise ValueError("flag_rows: pass b and b_bound together")
    if (record is not None or mark) and count is None:
        raise ValueError("flag_rows: a record and marks need count")
    if mark and not count.is_contiguous():
        raise ValueError("flag_rows: count must be contiguous to be marked in place")
    m, d = a.shape
    flags = torch.empty(m, dtype=torch.bool, device=a.device)
    if record is not None and check:
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
        CB=LIST_BLOCKS, SUB=LIST_SUB, num_warps=4,
    )
    return (flags, listed) if with_list else flags


KERNELS = {"dense_list": _dense_list_kernel, "flag_rows": _flag_rows_kernel}
