"""Shared test helpers: verbose comparisons, the float64 error metric, and FFN builders.

* ``assert_close_verbose``: ``torch.testing``-style closeness that, on failure, prints the worst
  elements (index, actual, expected) and the relative error of the whole tensor.
* ``rel_error``: the accuracy metric of docs/architecture.md, 'Exactness contract', ``‖out − ref₆₄‖ / ‖ref₆₄‖`` in float64,
  NaN-aware.
* ``make_ffn``: random FFN weights and inputs whose gate is active with a chosen density, built the
  way the bench controls density (docs/benchmarks.md, 'Method': a constant feature in ``x`` and a gate threshold at the
  normal quantile of the target density).
* ``dense_grads``: the autograd oracle for the backward, ``(out · dout).sum() + l1_scale · L1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------


def _nonfinite_mismatch(actual: Tensor, expected: Tensor) -> Tensor:
    """bool mask: positions where the non-finite pattern differs (NaN vs not, or a different Inf)."""
    a_nan, e_nan = actual.isnan(), expected.isnan()
    a_inf, e_inf = actual.isinf(), expected.isinf()
    inf_differs = (a_inf | e_inf) & ~(a_nan | e_nan) & (actual != expected)
    return (a_nan != e_nan) | inf_differs


def _describe_worst(actual: Tensor, expected: Tensor, score: Tensor, k: int) -> list[str]:
    flat = score.reshape(-1)
    k = min(k, int(flat.numel()))
    top = torch.topk(flat, k).indices if k else flat.new_zeros(0, dtype=torch.long)
    lines = []
    for i in top.tolist():
        if not flat[i] > 0:
            break
        index = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), actual.shape))
        a, e = actual.reshape(-1)[i].item(), expected.reshape(-1)[i].item()
        rel = abs(a - e) / abs(e) if e not in (0.0,) and math.isfinite(e) else float("nan")
        lines.append(f"    at {index}: actual={a!r} expected={e!r} |diff|={abs(a - e)!r} rel={rel:.3g}")
    return lines


def assert_close_verbose(
    actual: Tensor,
    expected: Tensor,
    *,
    rtol: float,
    atol: "float | Tensor",
    name: str = "",
    equal_nan: bool = True,
    show: int = 8,
) -> None:
    """Assert ``|actual − expected| <= atol + rtol·|expected|`` elementwise, loudly (``atol`` a
    number, or a tensor of per-element tolerances of the same shape).

    Both sides are compared in float64. Non-finite values must match exactly: NaN where the other
    is NaN (when ``equal_nan``), the same signed Inf where the other is Inf. On failure the message
    lists the ``show`` worst elements with their index, both values and their relative error, plus
    the relative error of the whole tensor (``rel_error``, NaN positions excluded).
    """
    label = f"[{name}] " if name else ""
    if actual.shape != expected.shape:
        raise AssertionError(f"{label}shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()

    bad_pattern = _nonfinite_mismatch(a, e) if equal_nan else (a.isnan() | e.isnan() | _nonfinite_mismatch(a, e))
    both_finite = torch.isfinite(a) & torch.isfinite(e)
    excess = torch.zeros_like(a)
    atol_t = torch.as_tensor(atol, dtype=torch.float64).cpu().expand_as(a)
    excess[both_finite] = (a - e).abs()[both_finite] - (atol_t[both_finite] + rtol * e.abs()[both_finite])
    bad_value = both_finite & (excess > 0)
    if not (bad_pattern.any() or bad_value.any()):
        return

    atol_text = f"{atol:g}" if isinstance(atol, (int, float)) else f"per element, up to {float(atol_t.max()):g}"
    lines = [f"{label}tensors are not close (rtol={rtol:g}, atol={atol_text}, shape={tuple(a.shape)}, "
             f"dtypes actual={actual.dtype} expected={expected.dtype})"]
    if bad_pattern.any():
        n = int(bad_pattern.sum())
        lines.append(f"  non-finite pattern differs at {n} element(s), e.g.:")
        idx = bad_pattern.nonzero()[:show]
        for row in idx.tolist():
            lines.append(f"    at {tuple(row)}: actual={a[tuple(row)].item()!r} expected={e[tuple(row)].item()!r}")
    if bad_value.any():
        n = int(bad_value.sum())
        lines.append(f"  {n} of {int(both_finite.sum())} finite element(s) out of tolerance; worst first:")
        lines.extend(_describe_worst(a, e, torch.where(bad_value, excess, torch.zeros_like(excess)), show))
    ok = ~(a.isnan() | e.isnan())
    if ok.any():
        diff = torch.where(ok & both_finite, a - e, torch.zeros_like(a))
        ref = torch.where(ok & both_finite, e, torch.zeros_like(e))
        denom = torch.linalg.vector_norm(ref).item()
        num = torch.linalg.vector_norm(diff).item()
        lines.append(f"  relative error ‖a−e‖/‖e‖ over finite positions: {num / denom if denom else num:.3e} "
                     f"(‖e‖={denom:.3e}, max|a−e|={diff.abs().max().item():.3e})")
    message = "\n".join(lines)
    print(message)
    raise AssertionError(message)


def rel_error(out: Tensor, ref64: Tensor, *, nan_mismatch: str = "raise") -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 (docs/architecture.md, 'Exactness contract'), NaN-aware.

    Positions where ``ref64`` is non-finite must hold the same value in ``out`` (NaN for NaN, the
    same signed Inf for an Inf) and are excluded from both norms. A non-finite ``out`` where
    ``ref64`` is finite, or a differing non-finite pattern, is a failure: it raises
    ``AssertionError`` (``nan_mismatch="raise"``) or returns ``inf`` (``nan_mismatch="inf"``, for
    measuring a baseline such as the dense path, which may itself overflow). When ``ref64`` is all
    zeros the absolute norm ``‖out‖`` is returned.
    """
    if nan_mismatch not in ("raise", "inf"):
        raise ValueError(f"nan_mismatch must be 'raise' or 'inf', got {nan_mismatch!r}")
    if out.shape != ref64.shape:
        raise AssertionError(f"shape mismatch: {tuple(out.shape)} vs {tuple(ref64.shape)}")
    o = out.detach().to(torch.float64).cpu()
    r = ref64.detach().to(torch.float64).cpu()
    mismatch = _nonfinite_mismatch(o, r) | (~torch.isfinite(o) & torch.isfinite(r))
    if mismatch.any():
        if nan_mismatch == "inf":
            return math.inf
        where = mismatch.nonzero()[:8].tolist()
        shown = ", ".join(f"{tuple(i)}: out={o[tuple(i)].item()!r} ref={r[tuple(i)].item()!r}" for i in where)
        raise AssertionError(f"non-finite pattern differs at {int(mismatch.sum())} element(s): {shown}")
    keep = torch.isfinite(r)
    num = torch.linalg.vector_norm(o[keep] - r[keep]).item()
    den = torch.linalg.vector_norm(r[keep]).item()
    return num / den if den > 0 else num


def assert_same_nonfinite(actual: Tensor, expected: Tensor, name: str = "") -> None:
    """Assert the NaN mask and the ±Inf positions of two tensors are identical."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    bad = _nonfinite_mismatch(a, e)
    if bad.any():
        where = bad.nonzero()[:8].tolist()
        shown = ", ".join(f"{tuple(i)}: actual={a[tuple(i)].item()!r} expected={e[tuple(i)].item()!r}" for i in where)
        raise AssertionError(
            f"[{name}] NaN/Inf pattern differs at {int(bad.sum())} of {a.numel()} element(s) "
            f"(actual has {int(a.isnan().sum())} NaN, expected {int(e.isnan().sum())}): {shown}"
        )


# ---------------------------------------------------------------------------------------------
# FFN builders
# ---------------------------------------------------------------------------------------------

GRAD_NAMES = ("dx", "dwg", "dwu", "dwd", "dbg", "dbu", "dbd")


@dataclass
class FFN:
    """Inputs of one FFN call in the reference's argument order (``wg is None`` for plain)."""

    x: Tensor  # [M, D]
    wg: Optional[Tensor]  # [H, D] or None (plain FFN)
    wu: Tensor  # [H, D]
    wd: Tensor  # [D, H]
    bg: Optional[Tensor] = None  # [H]
    bu: Optional[Tensor] = None  # [H]
    bd: Optional[Tensor] = None  # [D]

    @property
    def gated(self) -> bool:
        return self.wg is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def args(self) -> tuple:
        """``(x, wg, wu, wd, bg, bu, bd)``, the positional arguments of the reference functions."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def to(self, dtype: torch.dtype) -> "FFN":
        """A copy with every tensor cast to ``dtype`` (exact when widening, e.g. to float64)."""
        return FFN(*(None if t is None else t.detach().to(dtype) for t in self.args()))

    def double(self) -> "FFN":
        return self.to(torch.float64)

    def clone(self) -> "FFN":
        return FFN(*(None if t is None else t.detach().clone() for t in self.args()))

    def with_(self, **changes) -> "FFN":
        return replace(self, **changes)


def gate_threshold(density: Tensor) -> Tensor:
    """Threshold ``c`` with ``P(z + c > 0) = density`` for ``z ~ N(0, 1)``: the normal quantile."""
    p = density.to(torch.float64).clamp(1e-12, 1 - 1e-12)
    return math.sqrt(2.0) * torch.special.erfinv(2 * p - 1)


def make_ffn(
    m: int,
    d: int,
    h: int,
    *,
    density: float = 0.05,
    gated: bool = True,
    bias: bool = True,
    dtype: torch.dtype = torch.float32,
    skew: float = 0.0,
    hot_rows: Sequence[int] = (),
    seed: int = 0,
) -> FFN:
    """Random FFN inputs whose controlled pre-activation (gate, or up for a plain FFN) is > 0 with
    probability ``density`` per (token, neuron).

    Construction (float64, then one cast to ``dtype``):

    * ``x[:, 0] = 1`` is the constant feature; the other features are iid N(0, 1).
    * Each row of the controlled weight has unit norm over the random features, so its random part
      ``z[t, j]`` is N(0, 1) over tokens. Neuron j's threshold ``c_j`` (normal quantile of its
      density) goes into the bias when ``bias``, else into the constant feature's weight column.
      ``density`` 0 and 1 are exact: ``c_j`` is set past ``max |z|``.
    * ``skew > 0`` draws per-neuron densities ``∝ exp(skew · N(0, 1))`` (mean ``density``, capped
      at 1), so a few neurons are hot and most are nearly dead.
    * ``hot_rows``: those tokens are active in every neuron (rows that overflow every full tile).
      Uses feature 1 as a switch (0 elsewhere), so needs ``d >= 2``.

    Other weights: ``Wu ~ N(0, 1/d)`` (gated), ``Wd ~ N(0, 1/h)``, biases ~ N(0, 0.1²).
    """
    if m < 0 or d < 1 or h < 1:
        raise ValueError(f"need m >= 0, d >= 1, h >= 1; got m={m} d={d} h={h}")
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    hot_rows = sorted(set(int(r) for r in hot_rows))
    if hot_rows and d < 2:
        raise ValueError("hot_rows needs d >= 2 (feature 1 is the switch)")
    if hot_rows and not all(0 <= r < m for r in hot_rows):
        raise ValueError(f"hot_rows out of range 0..{m - 1}: {hot_rows}")

    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=f64)

    first_random = 2 if hot_rows else 1  # features [first_random, d) are iid N(0, 1)
    x = randn(m, d)
    x[:, 0] = 1.0
    if hot_rows:
        x[:, 1] = 0.0

    # Controlled weight: unit-norm random part, so z = x[:, r:] · w[j, r:] ~ N(0, 1) over tokens.
    w_ctrl = randn(h, d)
    if d > first_random:
        w_ctrl[:, first_random:] /= torch.linalg.vector_norm(w_ctrl[:, first_random:], dim=1, keepdim=True)
    w_ctrl[:, :first_random] = 0.0
    z = x[:, first_random:] @ w_ctrl[:, first_random:].T  # [m, h]

    if skew > 0 and 0.0 < density < 1.0:
        weight = torch.exp(skew * randn(h))
        per_neuron = (density * weight / weight.mean()).clamp(max=1.0)
    else:
        per_neuron = torch.full((h,), float(density), dtype=f64)
    thresh = gate_threshold(per_neuron)
    # Exact 0 and 1: step past the largest |z| (plus a margin that survives float16 rounding).
    margin = (z.abs().max().item() if z.numel() else 0.0) + 1.0
    thresh = torch.where(per_neuron <= 0, torch.full_like(thresh, -margin), thresh)
    thresh = torch.where(per_neuron >= 1, torch.full_like(thresh, margin), thresh)

    b_ctrl = None
    if bias:
        b_ctrl = thresh.clone()
    else:
        w_ctrl[:, 0] = thresh
    if hot_rows:
        # A hot row's gate is z + c + K with K beyond any negative z + c.
        w_ctrl[:, 1] = 1.0
        x[hot_rows, 1] = margin + thresh.abs().max().item() + 1.0

    if gated:
        wg, bg = w_ctrl, b_ctrl
        wu = randn(h, d) / math.sqrt(d)
        bu = 0.1 * randn(h) if bias else None
    else:
        wg, bg = None, None
        wu, bu = w_ctrl, b_ctrl
    wd = randn(d, h) / math.sqrt(h)
    bd = 0.1 * randn(d) if bias else None
    return FFN(x, wg, wu, wd, bg, bu, bd).to(dtype)


def dense_grads(ffn: FFN, dout: Tensor, l1_scale: float) -> tuple[Tensor, dict]:
    """Autograd of the dense FFN in ``ffn``'s dtype: ``(out · dout).sum() + l1_scale · (1/M) Σ|h|``.

    Returns ``(out, grads)`` with ``grads`` keyed by ``GRAD_NAMES`` (None for absent inputs). With
    ``l1_scale == 0`` the L1 term is left out of the graph entirely (docs/architecture.md, 'The L1 regularizer': zero turns
    it off exactly, so not even ``0 · NaN`` may leak in).
    """
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in ffn.args()]
    x, wg, wu, wd, bg, bu, bd = leaves
    up = torch.nn.functional.linear(x, wu, bu)
    if wg is None:
        hid = torch.relu(up)
    else:
        hid = torch.relu(torch.nn.functional.linear(x, wg, bg)) * up
    out = torch.nn.functional.linear(hid, wd, bd)
    loss = (out * dout.to(out.dtype)).sum()
    if l1_scale != 0:
        loss = loss + l1_scale * hid.abs().sum() / max(1, x.shape[0])
    inputs = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    it = iter(grads)
    result = {}
    for name, leaf in zip(GRAD_NAMES, leaves):
        if leaf is None:
            result[name] = None
        else:
            g = next(it)
            result[name] = torch.zeros_like(leaf) if g is None else g
    return out.detach(), result


def dense_l1(ffn: FFN) -> Tensor:
    """``(1/M) Σ_t Σ_j |h[t, j]|`` of the dense FFN, in ``ffn``'s dtype (0 for M = 0)."""
    x, wg, wu, wd, bg, bu, bd = ffn.args()
    up = torch.nn.functional.linear(x, wu, bu)
    hid = torch.relu(up) if wg is None else torch.relu(torch.nn.functional.linear(x, wg, bg)) * up
    return hid.abs().sum() / max(1, x.shape[0])


def make_ffn_with_pattern(
    active: Tensor,
    *,
    gated: bool = True,
    bias: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> FFN:
    """An FFN whose controlled pre-activation (gate, or up for a plain FFN) is active exactly on
    the ``True`` entries of ``active [M, H]``: +1 there, -1 elsewhere, exact in every dtype.

    ``x = [1, onehot(token)]`` (``D = M + 1``); neuron j's controlled weight is -1 on the constant
    feature (or its bias is -1) and +2 on the features of the tokens where it is active.
    """
    m, h = active.shape
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    d = m + 1
    x = torch.zeros(m, d, dtype=f64)
    x[:, 0] = 1.0
    x[torch.arange(m), torch.arange(m) + 1] = 1.0
    w_ctrl = torch.zeros(h, d, dtype=f64)
    w_ctrl[:, 1:] = 2.0 * active.T.to(f64)
    b_ctrl = None
    if bias:
        b_ctrl = torch.full((h,), -1.0, dtype=f64)
    else:
        w_ctrl[:, 0] = -1.0
    wd = torch.randn(d, h, generator=gen, dtype=f64) / math.sqrt(h)
    bd = 0.1 * torch.randn(d, generator=gen, dtype=f64) if bias else None
    if gated:
        wu = torch.randn(h, d, generator=gen, dtype=f64)
        bu = 0.1 * torch.randn(h, generator=gen, dtype=f64) if bias else None
        return FFN(x, w_ctrl, wu, wd, b_ctrl, bu, bd).to(dtype)
    return FFN(x, None, w_ctrl, wd, None, b_ctrl, bd).to(dtype)


def grad_magnitudes(ffn: "FFN", dout: Tensor, packed, up_val: Tensor, l1_scale: float):
    """``Σ |terms|`` of each gradient element of ``(out · dout).sum() + l1_scale · (1/M) Σ|h|``, in
    float64 (a ``reference.Grads``): the reference backward on the absolute values of every finite
    input, ``packed``/``up_val`` the forward's. Its masks are the original ones or wider (a stored
    finite value is active or >= 0 already; a dense row's recomputed pre-activation only grows), so
    each term it sums bounds one of the original's. Where a sum cancels, its summation order sets
    the result to about a unit roundoff of this magnitude."""
    from twell_compile.kernels import TwellPacked, reference

    def absolute(t):
        return None if t is None else torch.where(torch.isfinite(t), t.abs(), t).double()

    abs_packed = TwellPacked(packed.idx, absolute(packed.val), packed.count)
    return reference.ffn_backward_ref(absolute(dout), *(absolute(t) for t in ffn.args()), abs_packed, absolute(up_val),
                                      torch.tensor(abs(float(l1_scale)), dtype=torch.float64, device=dout.device))
