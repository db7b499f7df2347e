"""The backward's sparse rows, token-major: ``dh`` at every stored pair, then ``dx``.

Math (``reference.ffn_backward_ref``), for every stored pair ``(t, j)`` of a sparse row (not in
``dense_rows``), with ``g`` the stored pre-activation and ``u`` the up value the forward kept:

* ``dh = dout_t · Wd[:, j] + scale · sign(h)`` (``_tokens_dh_kernel``): a sampled dense-dense
  product plus the L1 gradient (docs/architecture.md, 'The L1 regularizer'), stored per slot;
* ``dx_t = Σ_j dgate · Wg_j + dup · Wu_j`` (``_tokens_dx_kernel``), from that ``dh``
  (``grad_math.pair_grads``).

A program owns ``TOKENS`` sparse rows, one after the other, and walks each row's stored pairs one
at a time with ``pair_walk``'s cursor, loading the next pair while this pair's rows arrive. The
``dh`` kernel keeps the ``dout`` row in registers and gathers one ``Wdᵀ`` row per pair, one warp a
token; the ``dx`` kernel gathers the ``Wg`` and ``Wu`` rows' columns of one block of at most
``DX_BLOCK_MAX`` columns, with that block's ``dx`` accumulator in registers, and its programs take
the column blocks in turn. Each kernel gathers 23 MB of weights at a time at the benchmark shape,
which the H200's L2 keeps: ``dh`` 0.250 ms and ``dx`` 0.432 ms at 0.5% density (M=16384, D=2048,
H=5632; 0.454 and 0.831 ms at 1%).

Bytes, 16-bit tensors (``e = 2``): per pair one ``Wdᵀ`` row and the ``Wg`` and ``Wu`` rows, ``3·D·e``
(12 KiB at D = 2048), plus ~28 B of TwELL and ``dh``; per token ``2·D·e`` (``dout`` in, ``dx`` out)
and ``n_tiles·4``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grad_math import hidden_values, pair_grads, sign_of
from .launch import cdiv, launch, next_power_of_2
from .pair_walk import (bit_walk, first_pair, join_row, load_pair, load_row, next_pair, paired, row_lanes, tile_set,
                        widen, zero_row)
from .triton_helpers import INTERPRET, column_mask, jit_helper, reduce_sum


# dx's column block: at most this many columns of D per program (the programs of one block run
# before those of the next). On the H200 at D=2048, 0.3-1% density, dx takes 0-7% less time in
# blocks of 1024 than over all of D with uniform neurons (the same with skewed ones), and 4-19%
# less than in blocks of 512.
DX_BLOCK_MAX = 1024


def _token_configs():
    if INTERPRET:
        return [triton.Config({"TOKENS": 2}, num_warps=4, num_stages=1)]
    # (warps, tokens per program). On the H200 (bf16, D=2048, H=5632, M=16384, 0.3-1% density) the
    # autotuner picks 1 warp for dh and 2 for dx's 1024-column blocks.
    shapes = [(1, 1), (2, 1), (4, 1), (2, 2)]
    return [triton.Config({"TOKENS": t}, num_warps=w, num_stages=1) for w, t in shapes]


def _prune_rows(rows: int):
    """An ``early_config_prune`` keeping configs whose ``rows`` fp32 rows of ``BLOCK_D`` (the row
    in registers and the one or two gathered per pair) fit ≤ 128 registers per thread."""
    def prune(configs, nargs, **kwargs):
        keep = [c for c in configs if rows * kwargs["BLOCK_D"] <= 128 * 32 * c.num_warps]
        return keep or [triton.Config({"TOKENS": 1}, num_warps=16, num_stages=1)]
    return prune


@jit_helper
def _row_cursor(count_ptr, t64, N_TILES, SLOTS: tl.constexpr, NT_P2: tl.constexpr, BITS: tl.constexpr):
    """``next_pair``'s cursor on the first stored pair of sparse row ``t64``, and its counts' base.
    A sparse row has no overflowed tile, so its stored pairs are all its pairs."""
    cnt_base = t64 * N_TILES
    tiles = tl.arange(0, NT_P2)
    rem = tl.full([], 0, tl.uint64)
    if BITS:
        rem = tile_set(tl.load(count_ptr + cnt_base + tiles, mask=tiles < N_TILES, other=0), tiles, SLOTS, BITS)
    rem, ct, cs, cc = first_pair(count_ptr, cnt_base, rem, N_TILES, SLOTS, BITS)
    return cnt_base, rem, ct, cs, cc


@triton.autotune(configs=_token_configs(), key=["D", "H", "GATED"], prune_configs_by={"early_config_prune": _prune_rows(2)})
@triton.heuristics({"EVEN_D": lambda a: a["D"] % a["BLOCK_D"] == 0})
@triton.jit
def _tokens_dh_kernel(
    # pointers
    dout_ptr, wdt_ptr, idx_ptr, val_ptr, up_ptr, count_ptr, dense_ptr, scale_ptr, dh_ptr,
    # dimensions and row strides (elements; every last dimension is contiguous)
    M, D, H, N_TILES, stride_gm, stride_wdt,
    # meta-parameters
    GATED: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
    NT_P2: tl.constexpr, BITS: tl.constexpr, PAIRS: tl.constexpr, EVEN_D: tl.constexpr, OVF: tl.constexpr,
):
    """``dh`` (fp32, TwELL shape, with the L1 term) at every stored slot of each sparse row ``t``
    (``dense[t] == 0``): ``dout[t] · Wdᵀ[j]`` over all of D.

    dout ``[M, D]``; wdt (= Wdᵀ) ``[H, D]``; TwELL idx/val/up ``[M, N_TILES, SLOTS]`` (up unused
    when plain), count ``[M, N_TILES]``; dense uint8 ``[M]``; scale fp32 ``[]`` = ``l1_scale / M``.
    """
    pid = tl.program_id(0)
    lanes, l_ok = row_lanes(0, D, BLOCK_D, PAIRS, EVEN_D)
    scale = tl.load(scale_ptr)
    for i in range(TOKENS):
        t = pid * TOKENS + i
        if t < M:
            t64 = t.to(tl.int64)
            if tl.load(dense_ptr + t64) == 0:
                g_ev, g_od = widen(load_row(dout_ptr, t64 * stride_gm, lanes, l_ok, PAIRS, ""), PAIRS)
                slot0 = t64 * N_TILES * SLOTS
                cnt_base, rem, ct, cs, cc = _row_cursor(count_ptr, t64, N_TILES, SLOTS, NT_P2, BITS)
                # Default L2 policy for the pairs: _tokens_dx_kernel and _wgrad_kernel read them
                # again. The next pair is loaded while this pair's row arrives.
                ok, slot, jp, pre = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS, "", OVF)
                while ok:
                    wd = load_row(wdt_ptr, jp * stride_wdt, lanes, l_ok, PAIRS, "")
                    up = pre
                    if GATED:
                        up = tl.load(up_ptr + slot)
                    rem, ct, cs, cc = next_pair(count_ptr, cnt_base, rem, ct, cs, cc, N_TILES, SLOTS, BITS)
                    next_ok, next_slot, next_jp, next_pre = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS,
                                                                      "", OVF)
                    act, hv = hidden_values(pre, up, GATED)
                    wd_ev, wd_od = widen(wd, PAIRS)
                    dh = reduce_sum(join_row(wd_ev * g_ev, wd_od * g_od, PAIRS), axis=0) + scale * sign_of(hv)
                    tl.store(dh_ptr + slot, dh)
                    ok, slot, jp, pre = next_ok, next_slot, next_jp, next_pre


@triton.autotune(configs=_token_configs(), key=["D", "H", "GATED"], prune_configs_by={"early_config_prune": _prune_rows(3)})
@triton.heuristics({"EVEN_D": lambda a: a["D"] % a["BLOCK_D"] == 0})
@triton.jit
def _tokens_dx_kernel(
    # pointers
    wg_ptr, wu_ptr, idx_ptr, val_ptr, up_ptr, count_ptr, dense_ptr, dh_ptr, dx_ptr,
    # dimensions and row strides (elements)
    M, D, H, N_TILES, stride_wg, stride_wu, stride_dxm,
    # meta-parameters
    GATED: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
    NT_P2: tl.constexpr, BITS: tl.constexpr, PAIRS: tl.constexpr, EVEN_D: tl.constexpr, OVF: tl.constexpr,
):
    """``dx[t] = Σ_j dgate · Wg[j] + dup · Wu[j]`` over the stored pairs of each sparse row, from
    ``_tokens_dh_kernel``'s ``dh``; one ``BLOCK_D`` column block per program, the programs of block
    ``b`` (``pid // cdiv(M, TOKENS)``) before those of block ``b + 1``. Plain: ``wg`` is unused.
    """
    pid = tl.program_id(0)
    n_prog = tl.cdiv(M, TOKENS)
    block = pid // n_prog
    lanes, l_ok = row_lanes(block, D, BLOCK_D, PAIRS, EVEN_D)
    offs_d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = column_mask(offs_d, D, EVEN_D)
    for i in range(TOKENS):
        t = (pid % n_prog) * TOKENS + i
        if t < M:
            t64 = t.to(tl.int64)
            if tl.load(dense_ptr + t64) == 0:
                acc_ev, acc_od = zero_row(lanes, PAIRS)
                slot0 = t64 * N_TILES * SLOTS
                cnt_base, rem, ct, cs, cc = _row_cursor(count_ptr, t64, N_TILES, SLOTS, NT_P2, BITS)
                ok, slot, jp, pre = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS, "", OVF)
                while ok:
                    wu = load_row(wu_ptr, jp * stride_wu, lanes, l_ok, PAIRS, "")
                    dh = tl.load(dh_ptr + slot)
                    up = pre
                    if GATED:
                        up = tl.load(up_ptr + slot)
                        wg = load_row(wg_ptr, jp * stride_wg, lanes, l_ok, PAIRS, "")
                    rem, ct, cs, cc = next_pair(count_ptr, cnt_base, rem, ct, cs, cc, N_TILES, SLOTS, BITS)
                    next_ok, next_slot, next_jp, next_pre = load_pair(idx_ptr, val_ptr, slot0, ct, cs, N_TILES, SLOTS,
                                                                      "", OVF)
                    act, hv = hidden_values(pre, up, GATED)
                    d_gate, d_up = pair_grads(pre, up, act, dh, GATED)
                    wu_ev, wu_od = widen(wu, PAIRS)
                    acc_ev += d_up * wu_ev
                    acc_od += d_up * wu_od
                    if GATED:
                        wg_ev, wg_od = widen(wg, PAIRS)
                        acc_ev += d_gate * wg_ev
                        acc_od += d_gate * wg_od
                    ok, slot, jp, pre = next_ok, next_slot, next_jp, next_pre
                acc = join_row(acc_ev, acc_od, PAIRS)
                tl.store(dx_ptr + t64 * stride_dxm + offs_d, acc.to(dx_ptr.dtype.element_ty), mask=d_ok)


def tokens_backward(dout: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wdt: torch.Tensor, idx: torch.Tensor,
                    val: torch.Tensor, up: torch.Tensor, count: torch.Tensor, dense_u8: torch.Tensor,
                    scale: torch.Tensor, dh: torch.Tensor, dx: torch.Tensor, *, gated: bool, ovf: float) -> None:
    """``dh`` at every stored slot of the sparse rows (``dense_u8 == 0``), then their ``dx`` rows;
    the dense rows' slots and rows are left alone. Two launches.

    The operands as ``sparse_ffn_backward`` prepares them: row-major ``dout``, ``wg``, ``wu`` and
    ``wdt`` (Wdᵀ ``[H, D]``; plain FFNs pass ``wu`` as ``wg``), contiguous TwELL ``idx``, ``val``,
    ``up`` ``[M, n_tiles, slots]`` and ``count``, ``scale`` fp32 ``[]`` = ``l1_scale / M``, ``dh`` fp32
    ``[M, n_tiles, slots]``, ``dx [M, D]``; ``ovf``: ``pair_walk.overflow_threshold`` of the input dtype.
    """
    m, d = dout.shape
    h = wu.shape[0]
    n_tiles, slots = count.shape[1], idx.shape[2]
    block_d = max(16, next_power_of_2(d))
    nt_p2 = max(2, next_power_of_2(n_tiles))
    walk = dict(GATED=gated, SLOTS=slots, NT_P2=nt_p2, BITS=bit_walk(nt_p2), OVF=ovf)
    launch(_tokens_dh_kernel, lambda meta: (cdiv(m, meta["TOKENS"]),),
        dout, wdt, idx, val, up, count, dense_u8, scale, dh, m, d, h, n_tiles, dout.stride(0), wdt.stride(0),
        BLOCK_D=block_d, PAIRS=paired(dout, wdt), **walk,
    )
    block_dx = min(block_d, DX_BLOCK_MAX)
    launch(_tokens_dx_kernel, lambda meta: (cdiv(d, block_dx) * cdiv(m, meta["TOKENS"]),),
        wg, wu, idx, val, up, count, dense_u8, dh, dx, m, d, h, n_tiles, wg.stride(0), wu.stride(0), dx.stride(0),
        BLOCK_D=block_dx, PAIRS=paired(wg, wu), **walk,
    )


KERNELS = {"tokens_dh": _tokens_dh_kernel, "tokens_dx": _tokens_dx_kernel}
