"""Pure-PyTorch reference for TwELL: the executable specification, the CPU path and the test oracle.

Shapes: ``x [M, D]``; gate/up weights ``[H, D]`` (``nn.Linear`` layout); down weight ``[D, H]``;
biases ``[H]`` / ``[D]`` or ``None``. Gated FFN: ``out = (relu(x Wgᵀ + bg) ⊙ (x Wuᵀ + bu)) Wdᵀ + bd``.
Plain FFN (``wg is None``): ``out = relu(x Wuᵀ + bu) Wdᵀ + bd``.

The sparse algorithm, which the Triton kernels implement too:

1. ``gate_pack_ref``: the gate pre-activation is packed into TwELL (``format.py``); the dense
   gate is never needed again. (For a plain FFN the up pre-activation is packed.)
2. ``dense_rows_ref``: rows that must be computed densely to stay exact: rows with an overflowed
   tile, and rows the finiteness guard flags (below).
3. ``ffn_forward_ref``: for every stored (token t, neuron j) pair of the other rows, the up value
   ``x_t · Wu_j + bu_j`` and ``h = relu(g) · up`` are computed and ``h · Wd[:, j]`` is accumulated
   into ``out[t]``. Dense rows use the dense formula. Nothing is dropped.
4. ``ffn_backward_ref``: every product is restricted to the same pairs; the L1 gradient
   ``l1_scale / M · sign(h)`` is added to ``dh`` (docs/architecture.md, 'The L1 regularizer').

Exactness guard. The sparse path skips ``0 · v`` products that the dense path performs. They are
zero unless ``v`` is Inf/NaN, in which case dense PyTorch yields NaN. So a row is computed densely
whenever such a product could be non-finite: when any weight or bias is non-finite (all rows), when
the row of ``x`` (or of ``dout`` in backward) is non-finite, or, for a gated FFN, when the
Cauchy-Schwarz bound ``|x_t · Wu_j + bu_j| <= ||x_t|| max_j ||Wu_j|| + max |bu|`` does not rule out
an overflow to Inf in the input dtype (in practice: float16 with huge activations).

Arithmetic runs in ``compute_dtype``: float32 for float16/bfloat16 inputs, float64 for float32
and float64 inputs, and rounds once, at the output, so the sparse path is at least as accurate
as dense PyTorch in the same dtype. Where dense PyTorch rounds an intermediate (gate, up, h, dh,
dgate, dup) to the input dtype, ``overflow_like`` reproduces only what that rounding can do to
the value's finiteness: a value beyond the dtype's range becomes ±Inf, exactly as dense would
make it, so Inf and NaN patterns match too (for example 0 · Inf = NaN in a guarded float16 row).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .format import DEFAULT_LAYOUT, TwellLayout, TwellPacked, accumulation_dtype, is_active

# Smallest magnitude that rounds to Inf (round to nearest even): the dtype's max plus half an ulp.
OVERFLOW_THRESHOLD = {
    torch.float16: 65520.0,
    torch.bfloat16: 2.0**127 * (2 - 2.0**-8),
    torch.float32: 2.0**127 * (2 - 2.0**-24),
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the reference computes in: wider than the input, so it rounds once, at the end."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def overflow_like(v: Tensor, dtype: torch.dtype) -> Tensor:
    """``v`` with the values that rounding to ``dtype`` would overflow replaced by ±Inf."""
    threshold = OVERFLOW_THRESHOLD.get(dtype)
    if threshold is None or v.dtype == dtype:
        return v
    return torch.where(v.abs() >= threshold, v * float("inf"), v)

# Work on (token, neuron) pairs in chunks of this many pair×feature elements, to bound memory.
_CHUNK_ELEMS = 1 << 22


def _acc(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return None if t is None else t.to(dtype)


def _linear(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    out = x @ w.T  # reads x [R, D], w [N, D]; writes [R, N]
    return out if b is None else out + b


def dense_ffn_ref(x, wg, wu, wd, bg=None, bu=None, bd=None) -> Tensor:
    """The dense FFN, in the dtype of its inputs: what the rewrite must reproduce."""
    up = _linear(x, wu, bu)
    h = torch.relu(up) if wg is None else torch.relu(_linear(x, wg, bg)) * up
    return _linear(h, wd, bd)


# ---------------------------------------------------------------------------------------------
# Format: pack / unpack
# ---------------------------------------------------------------------------------------------


def pack_ref(pre: Tensor, layout: TwellLayout = DEFAULT_LAYOUT) -> TwellPacked:
    """Pack a dense pre-activation ``pre [M, H]`` into TwELL (values keep ``pre``'s dtype)."""
    m, hidden = pre.shape
    n_tiles = layout.n_tiles(hidden)
    padded = pre.new_zeros(m, n_tiles * layout.tile_n)  # zero padding is inactive
    padded[:, :hidden] = pre
    tiles = padded.view(m, n_tiles, layout.tile_n)
    active = is_active(tiles)  # [M, n_tiles, tile_n]
    count = active.sum(-1, dtype=torch.int32)
    # Rank of each active entry inside its tile row: first actives get the first slots.
    rank = active.cumsum(-1) - 1
    keep = active & (rank < layout.slots)
    m_i, t_i, c_i = keep.nonzero(as_tuple=True)
    idx = torch.zeros(m, n_tiles, layout.slots, dtype=torch.int32, device=pre.device)
    val = torch.zeros(m, n_tiles, layout.slots, dtype=pre.dtype, device=pre.device)
    s_i = rank[m_i, t_i, c_i]
    idx[m_i, t_i, s_i] = (t_i * layout.tile_n + c_i).to(torch.int32)
    val[m_i, t_i, s_i] = tiles[m_i, t_i, c_i]
    return TwellPacked(idx=idx, val=val, count=count)


def unpack_ref(packed: TwellPacked, hidden: int) -> Tensor:
    """Decode to a dense ``relu(pre)`` of shape ``[M, H]`` from the stored entries.

    Rows listed by ``packed.overflow_rows()`` are incomplete by construction (their extra
    entries were never stored); every consumer computes those rows densely instead.
    """
    m = packed.count.shape[0]
    stored = packed.stored_mask()
    dense = packed.val.new_zeros(m, hidden)
    rows = torch.arange(m, device=dense.device).view(m, 1, 1).expand_as(stored)
    dense[rows[stored], packed.idx[stored].long()] = packed.val[stored]
    return dense


def fired_neurons(packed: TwellPacked, hidden: int, layout: TwellLayout = DEFAULT_LAYOUT) -> Tensor:
    """bool ``[hidden]``: the neurons ``packed`` stores an entry of. An overflowed tile row stores
    only its first entries, so every neuron of a tile that overflowed in some row counts as fired:
    a dead neuron is never overcounted. (``fired_neurons.stamp_fired`` stamps these on the device.)"""
    cols = torch.where(packed.stored_mask(), packed.idx.long(), hidden).reshape(-1)
    fired = torch.zeros(hidden + 1, dtype=torch.bool, device=cols.device).scatter_(0, cols, True)[:hidden]
    overflowed = (packed.count > layout.slots).any(dim=0)  # [n_tiles]
    return fired | overflowed.repeat_interleave(layout.tile_n)[:hidden]


def gate_pack_ref(x: Tensor, w: Tensor, b: Optional[Tensor] = None, layout: TwellLayout = DEFAULT_LAYOUT) -> TwellPacked:
    """``pack(x wᵀ + b)``: what the gate GEMM with the TwELL epilogue produces.

    Values are stored in ``accumulation_dtype`` (float32; float64 for float64 inputs), as
    accumulated: not rounded to the input dtype, so a 16-bit input's value past that dtype's range
    stays finite. Consumers map it as dense PyTorch's rounding would (``stored_pre``).
    """
    comp = compute_dtype(x.dtype)
    pre = _linear(x.to(comp), w.to(comp), _acc(b, comp))
    return pack_ref(pre.to(accumulation_dtype(x.dtype)), layout)


# ---------------------------------------------------------------------------------------------
# Which rows go dense
# ---------------------------------------------------------------------------------------------


def finite(*tensors: Optional[Tensor]) -> Tensor:
    """0-d bool: every element of every given tensor is finite (``None`` entries are skipped)."""
    flags = [torch.isfinite(t).all() for t in tensors if t is not None]
    return torch.stack(flags).all()


def may_overflow(rows: Tensor, weight_rows: Tensor, bias: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """bool [R]: can ``rows[r] · weight_rows[j] (+ bias[j])`` reach Inf in ``dtype`` for some j?"""
    acc = accumulation_dtype(dtype)
    bound = torch.linalg.vector_norm(rows.to(acc), dim=-1) * torch.linalg.vector_norm(weight_rows.to(acc), dim=-1).max()
    if bias is not None:
        bound = bound + bias.to(acc).abs().max()
    return ~(bound < torch.finfo(dtype).max)  # NaN bound → True


def guard_bounds_ref(wg, wu, wd, bg, bu, bd):
    """``weights.guard_bounds`` in tensor ops: ``(forward, backward)`` fp32 ``[3]`` bounds for
    ``flag_rows_ref``: ``[max‖Wu_j‖, offset, limit]`` and ``[max‖Wd[:, j]‖, 0, limit]`` (gated;
    plain FFNs get scale 0), where ``offset`` is ``max|bu|`` (gated), or +Inf when any weight or
    bias is non-finite, and ``limit`` the dtype's largest value. Norms are fp32 sums of squares."""
    dev, f32 = wu.device, torch.float32
    zero = torch.zeros((), dtype=f32, device=dev)
    offset = torch.where(finite(wg, wu, wd, bg, bu, bd), zero, float("inf"))
    limit = torch.full((), torch.finfo(wu.dtype).max, dtype=f32, device=dev)
    if wg is None:
        return torch.stack([zero, offset, limit]), torch.stack([zero, zero, limit])
    up_norm = torch.sqrt((wu.to(f32) ** 2).sum(-1)).max()
    if bu is not None:
        offset = offset + bu.to(f32).abs().max()
    down_norm = torch.sqrt((wd.to(f32) ** 2).sum(0)).max()  # columns of Wd
    return torch.stack([up_norm, offset, limit]), torch.stack([down_norm, zero, limit])


def flag_rows_ref(a, a_bound, b=None, b_bound=None, count=None, slots: int = 0, flag_overflow: bool = False):
    """``row_lists.flag_rows``: ``(flags, (Σ count, rows flagged or overflowed))``. A row is
    flagged unless ``‖a[r]‖·a_bound[0] + a_bound[1] < a_bound[2]`` (fp32), the same for ``b``, and
    with ``flag_overflow`` when a tile of ``count`` overflows ``slots``.

    The norm is the kernel's: a plain fp32 sum of squares, so a finite row whose squares overflow
    fp32 (|x| above ~1.8e19) has an infinite norm and is flagged, which only costs speed. (On CPU
    ``torch.linalg.vector_norm`` accumulates fp32 in float64 and would not flag it.)"""

    def exceeds(t, bound):
        t = t.float()
        norm = torch.sqrt((t * t).sum(-1))
        return ~(norm * bound[0].float() + bound[1].float() < bound[2].float())

    flags = exceeds(a, a_bound)
    if b is not None:
        flags |= exceeds(b, b_bound)
    if count is None:
        return flags, None
    dense = flags | (count > slots).any(-1)
    return (dense if flag_overflow else flags), (count.double().sum(), dense.double().sum())


def dense_rows_ref(x, wg, wu, wd, bg, bu, bd, packed: TwellPacked) -> Tensor:
    """bool [M]: forward rows that take the dense path (overflow, or the finiteness guard)."""
    rows = packed.overflow_rows() | ~torch.isfinite(x).all(-1)
    if wg is not None and x.shape[0] > 0:
        rows |= may_overflow(x, wu, bu, x.dtype)
    return rows | ~finite(wg, wu, wd, bg, bu, bd)


def backward_dense_rows_ref(dout, x, wg, wu, wd, bg, bu, bd, packed: TwellPacked) -> Tensor:
    """bool [M]: backward rows that take the dense path: the forward's, plus rows of ``dout``
    that are non-finite or, for a gated FFN, whose ``dh = dout Wd`` may overflow."""
    rows = dense_rows_ref(x, wg, wu, wd, bg, bu, bd, packed) | ~torch.isfinite(dout).all(-1)
    if wg is not None and x.shape[0] > 0:
        rows |= may_overflow(dout, wd.T, None, dout.dtype)
    return rows


# ---------------------------------------------------------------------------------------------
# Sparse products on (token, neuron) pairs
# ---------------------------------------------------------------------------------------------


class Pairs(NamedTuple):
    """The stored (token, neuron) pairs of the sparse rows, flattened."""

    token: Tensor  # int64 [P]
    neuron: Tensor  # int64 [P]
    where: tuple  # (m, tile, slot) index tensors into the TwELL buffer
    pre: Tensor  # [P] packed pre-activation value, as stored (``stored_pre`` maps its overflow)


def stored_pre(pairs: Pairs, acc: torch.dtype, dtype: torch.dtype) -> Tensor:
    """The pairs' pre-activations in ``acc`` as the dense path sees them: ±Inf where rounding to
    the input ``dtype`` would overflow (``overflow_like``; the packed values are not rounded)."""
    return overflow_like(pairs.pre.to(acc), dtype)


def stored_pairs(packed: TwellPacked, sparse_rows: Tensor) -> Pairs:
    mask = packed.stored_mask() & sparse_rows.view(-1, 1, 1)
    m_i, t_i, s_i = mask.nonzero(as_tuple=True)
    return Pairs(m_i, packed.idx[m_i, t_i, s_i].long(), (m_i, t_i, s_i), packed.val[m_i, t_i, s_i])


def _chunks(n_pairs: int, width: int):
    step = max(1, _CHUNK_ELEMS // max(1, width))
    for start in range(0, n_pairs, step):
        yield slice(start, min(n_pairs, start + step))


def pair_dot(a: Tensor, a_rows: Tensor, b: Tensor, b_rows: Tensor) -> Tensor:
    """``[P]``: ``a[a_rows[p]] · b[b_rows[p]]`` for each pair (a sampled dense-dense product)."""
    out = a.new_empty(a_rows.shape[0])
    for c in _chunks(a_rows.shape[0], a.shape[1]):
        out[c] = (a[a_rows[c]] * b[b_rows[c]]).sum(-1)  # reads 2 rows of width D per pair
    return out


def scatter_outer(out: Tensor, out_rows: Tensor, coef: Tensor, src: Tensor, src_rows: Tensor) -> None:
    """``out[out_rows[p]] += coef[p] · src[src_rows[p]]`` for each pair (a sparse × dense product)."""
    for c in _chunks(out_rows.shape[0], src.shape[1]):
        out.index_add_(0, out_rows[c], coef[c, None] * src[src_rows[c]])


# ---------------------------------------------------------------------------------------------
# Forward and backward
# ---------------------------------------------------------------------------------------------


class ForwardResult(NamedTuple):
    out: Tensor  # [M, D] in x.dtype
    packed: TwellPacked  # the packed gate (gated) or up (plain) pre-activation
    up_val: Tensor  # [M, n_tiles, slots] up values at the stored slots (gated; 0 elsewhere here, unspecified
    # from the CUDA kernels); [0] for plain
    dense_rows: Tensor  # bool [M]
    l1: Tensor  # 0-d: (1/M) Σ |h| over every row, in accumulation_dtype (float32; float64 for float64)


def ffn_forward_ref(x, wg, wu, wd, bg=None, bu=None, bd=None, layout: TwellLayout = DEFAULT_LAYOUT) -> ForwardResult:
    """The TwELL forward: pack, then up and down on the stored pairs only; dense rows densely."""
    acc = compute_dtype(x.dtype)
    gated = wg is not None
    x32, wu32, wd32, bu32 = x.to(acc), wu.to(acc), wd.to(acc), _acc(bu, acc)
    packed = gate_pack_ref(x, wg, bg, layout) if gated else gate_pack_ref(x, wu, bu, layout)
    dense_rows = dense_rows_ref(x, wg, wu, wd, bg, bu, bd, packed)

    out = x32.new_zeros(x.shape[0], wd.shape[0])
    up_val = packed.val.new_zeros(packed.val.shape if gated else (0,))
    pairs = stored_pairs(packed, ~dense_rows)
    pre = stored_pre(pairs, acc, x.dtype)
    if gated:
        up = pair_dot(x32, pairs.token, wu32, pairs.neuron)  # up only where the gate is active
        if bu32 is not None:
            up = up + bu32[pairs.neuron]
        up = overflow_like(up, x.dtype)
        up_val[pairs.where] = up.to(up_val.dtype)
        h = overflow_like(torch.relu(pre) * up, x.dtype)
    else:
        h = torch.relu(pre)
    scatter_outer(out, pairs.token, h, wd32.T, pairs.neuron)  # out[t] += h · Wd[:, j]
    l1 = h.abs().sum()

    rows = dense_rows.nonzero().squeeze(1)
    if rows.numel():
        h_rows = _dense_hidden(x32[rows], wg, wu32, bg, bu32, acc, x.dtype)
        out[rows] = h_rows @ wd32.T
        l1 = l1 + h_rows.abs().sum()
    if bd is not None:
        out += bd.to(acc)
    return ForwardResult(out.to(x.dtype), packed, up_val, dense_rows, (l1 / max(1, x.shape[0])).to(accumulation_dtype(x.dtype)))


def _dense_hidden(x_rows, wg, wu32, bg, bu32, acc, dtype):
    """h for whole rows, with dense PyTorch's overflow points (``overflow_like``)."""
    up = overflow_like(_linear(x_rows, wu32, bu32), dtype)
    if wg is None:
        return torch.relu(up)
    gate = overflow_like(_linear(x_rows, wg.to(acc), _acc(bg, acc)), dtype)
    return overflow_like(torch.relu(gate) * up, dtype)


def _dh(sampled: Tensor, h: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``dh = dout · Wd + scale · sign(h)``, each term overflowing where dense autograd's would."""
    return overflow_like(overflow_like(sampled, dtype) + scale * torch.sign(h), dtype)


class Grads(NamedTuple):
    dx: Tensor
    dwg: Optional[Tensor]
    dwu: Tensor
    dwd: Tensor
    dbg: Optional[Tensor]
    dbu: Optional[Tensor]
    dbd: Optional[Tensor]


def ffn_backward_ref(dout, x, wg, wu, wd, bg, bu, bd, packed: TwellPacked, up_val: Tensor, l1_scale: Tensor) -> Grads:
    """Gradients of ``loss + l1_scale · L1`` where ``L1 = (1/M) Σ |h|`` (docs/architecture.md,
    'The L1 regularizer').

    ``l1_scale`` is the 0-d coefficient of this layer's L1 term: ``l1_coeff · l1_factor``.
    """
    acc = compute_dtype(x.dtype)
    dtype = x.dtype
    gated = wg is not None
    m = x.shape[0]
    x32, wu32, wd32, g32 = x.to(acc), wu.to(acc), wd.to(acc), dout.to(acc)
    wg32 = wg.to(acc) if gated else None
    scale = l1_scale.to(acc) / max(1, m)
    dense_rows = backward_dense_rows_ref(dout, x, wg, wu, wd, bg, bu, bd, packed)

    dx = torch.zeros_like(x32)
    dwu = torch.zeros_like(wu32)
    dwd_t = torch.zeros_like(wd32.T.contiguous())  # [H, D]: row j is dWd[:, j]
    dwg = torch.zeros_like(wg32) if gated else None
    dbu = wu32.new_zeros(wu.shape[0]) if bu is not None else None
    dbg = wu32.new_zeros(wu.shape[0]) if (gated and bg is not None) else None

    # Sparse rows: every product runs on the stored pairs only.
    p = stored_pairs(packed, ~dense_rows)
    pre = stored_pre(p, acc, dtype)
    if gated:
        act, up = torch.relu(pre), up_val[p.where].to(acc)
        h = overflow_like(act * up, dtype)
    else:
        act = up = None
        h = torch.relu(pre)
    dh = _dh(pair_dot(g32, p.token, wd32.T, p.neuron), h, scale, dtype)  # sampled dout · Wd
    if gated:
        d_gate = torch.where(pre <= 0, 0.0, overflow_like(dh * up, dtype))  # relu'(g): passes unless g <= 0
        d_up = overflow_like(dh * act, dtype)
        scatter_outer(dx, p.token, d_gate, wg32, p.neuron)
        scatter_outer(dwg, p.neuron, d_gate, x32, p.token)
        if dbg is not None:
            dbg.index_add_(0, p.neuron, d_gate)
    else:
        d_up = torch.where(pre <= 0, 0.0, dh)
    scatter_outer(dx, p.token, d_up, wu32, p.neuron)
    scatter_outer(dwu, p.neuron, d_up, x32, p.token)
    scatter_outer(dwd_t, p.neuron, h, g32, p.token)
    if dbu is not None:
        dbu.index_add_(0, p.neuron, d_up)

    # Dense rows: the dense formulas on those rows.
    rows = dense_rows.nonzero().squeeze(1)
    if rows.numel():
        xr, gr = x32[rows], g32[rows]
        up_r = overflow_like(_linear(xr, wu32, _acc(bu, acc)), dtype)
        pre_r = overflow_like(_linear(xr, wg32, _acc(bg, acc)), dtype) if gated else up_r
        act_r = torch.relu(pre_r)
        h_r = overflow_like(act_r * up_r, dtype) if gated else act_r
        dh_r = _dh(gr @ wd32, h_r, scale, dtype)
        if gated:
            d_gate_r = torch.where(pre_r <= 0, 0.0, overflow_like(dh_r * up_r, dtype))
            d_up_r = overflow_like(dh_r * act_r, dtype)
            dx[rows] += d_gate_r @ wg32
            dwg += d_gate_r.T @ xr
            if dbg is not None:
                dbg += d_gate_r.sum(0)
        else:
            d_up_r = torch.where(pre_r <= 0, 0.0, dh_r)
        dx[rows] += d_up_r @ wu32
        dwu += d_up_r.T @ xr
        dwd_t += h_r.T @ gr
        if dbu is not None:
            dbu += d_up_r.sum(0)

    dbd = g32.sum(0) if bd is not None else None

    def cast(t, like):
        return None if t is None else t.to(like.dtype)

    return Grads(
        dx=dx.to(x.dtype),
        dwg=cast(dwg, wg),
        dwu=dwu.to(wu.dtype),
        dwd=dwd_t.T.to(wd.dtype),
        dbg=cast(dbg, bg),
        dbu=cast(dbu, bu),
        dbd=cast(dbd, bd),
    )
