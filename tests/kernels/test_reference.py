"""The pure-PyTorch TwELL reference (kernels/reference.py) against dense PyTorch.

Oracles:

* forward: ``dense_ffn_ref`` on float64 copies of the same inputs;
* backward: float64 autograd of ``(out · dout).sum() + l1_scale · (1/M) Σ|h|`` (``tests.utils.dense_grads``);
* accuracy (docs/architecture.md, 'Exactness contract'): in fp32/fp16/bf16 the reference's
  ``‖out − ref₆₄‖/‖ref₆₄‖`` must be no worse than dense PyTorch's in the same dtype, times
  ``ACCURACY_SLACK``, plus one unit roundoff of its sums' magnitude (``tiny`` × ``condition``);
* NaN/Inf (docs/architecture.md, 'Exactness contract'): exactly dense PyTorch's NaN (and Inf)
  pattern in the same dtype.

The Hypothesis configurations (``tests.strategies.ffn_configs``) cover M = 0, sizes that fit no
tile, densities 0..100 %, skewed neurons, rows forced all-active (overflow-heavy), gated/plain,
bias/no bias, and small layouts that overflow often.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import FFNConfig, ffn_configs
from tests.utils import (
    FFN,
    GRAD_NAMES,
    assert_close_verbose,
    assert_same_nonfinite,
    dense_grads,
    dense_l1,
    grad_magnitudes,
    make_ffn,
    make_ffn_with_pattern,
    rel_error,
)
from twell_compile.kernels.format import DEFAULT_LAYOUT, TwellLayout, accumulation_dtype
from twell_compile.kernels.reference import (
    backward_dense_rows_ref,
    dense_ffn_ref,
    dense_rows_ref,
    ffn_backward_ref,
    ffn_forward_ref,
    gate_pack_ref,
    pack_ref,
)

NAN, INF = float("nan"), float("inf")
F64 = torch.float64

# In float64 the reference must match dense float64 to this relative error (‖·‖ over the tensor).
FLOAT64_REL = 1e-12
# docs/architecture.md, 'Exactness contract': "no less accurate than the dense PyTorch path in the
# same dtype". The slack absorbs noise in the comparison; the epsilon only matters when both errors
# are ~0.
ACCURACY_SLACK = 1.05


def tiny(dtype: torch.dtype) -> float:
    """Slack for the accuracy bar: the dtype's unit roundoff. Rounding the exact result once costs
    up to that much, and on outputs of a few elements a dense result can be luckier than the
    correctly rounded one; beyond one unit roundoff the sparse path must match dense or beat it."""
    return torch.finfo(dtype).eps / 2


def _ratio(magnitude: torch.Tensor, result: torch.Tensor) -> float:
    norm = torch.linalg.vector_norm(result).item()
    return max(1.0, torch.linalg.vector_norm(magnitude).item() / norm) if norm else 1.0


def condition(ffn64) -> float:
    """``‖Σ|terms|‖ / ‖ref‖`` (≥ 1) of the FFN's sums, in float64: the FFN of the inputs' absolute
    values over its active neurons, against its result. The accuracy bar's unit roundoff is of the
    sums' magnitude: where they cancel, either summation order can be the luckier by that much
    (Hypothesis found the reference 2.3× dense's 1.2 units on a 2 × 2 float32 output of condition
    28), which no order is responsible for."""
    x, wg, wu, wd, bg, bu, bd = ffn64.args()

    def linear(a, w, b):
        return a @ w.T + (0 if b is None else b)

    def absolute(t):
        return None if t is None else t.abs()

    up_mag = linear(x.abs(), wu.abs(), absolute(bu))
    pre = linear(x, wu, bu) if wg is None else linear(x, wg, bg)
    pre_mag = up_mag if wg is None else linear(x.abs(), wg.abs(), absolute(bg))
    h_mag = torch.where(pre > 0, pre_mag, 0.0) * (1.0 if wg is None else up_mag)
    return _ratio(linear(h_mag, wd.abs(), absolute(bd)), dense_ffn_ref(x, wg, wu, wd, bg, bu, bd))


def grad_conditions(ffn64, dout64, l1_scale: float, ref: dict) -> dict:
    """``condition`` for each gradient of ``(out · dout).sum() + l1_scale · (1/M) Σ|h|`` (``ref``:
    the float64 gradients by name), from ``grad_magnitudes`` on the float64 forward's TwELL buffers."""
    fwd = ffn_forward_ref(*ffn64.args())
    magnitudes = grad_magnitudes(ffn64, dout64, fwd.packed, fwd.up_val, l1_scale)
    return {name: _ratio(getattr(magnitudes, name), ref[name]) for name in ref if ref[name] is not None}


L1_SCALES = st.sampled_from([0.0, 0.0, 1e-3, 0.5, 3.0])


def forward(ffn: FFN, layout: TwellLayout = DEFAULT_LAYOUT):
    return ffn_forward_ref(*ffn.args(), layout=layout)


def backward(ffn: FFN, dout: torch.Tensor, l1_scale: float, layout: TwellLayout = DEFAULT_LAYOUT):
    fwd = forward(ffn, layout)
    grads = ffn_backward_ref(dout, *ffn.args(), fwd.packed, fwd.up_val, torch.tensor(l1_scale, dtype=F64))
    return fwd, grads


def random_dout(ffn: FFN, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    m, d = ffn.x.shape
    return torch.randn(m, d, generator=gen, dtype=F64).to(ffn.dtype)


def assert_float64_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """float64 agreement: relative error ≤ FLOAT64_REL overall, and elementwise with a scaled atol."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    assert_close_verbose(actual, expected, rtol=1e-9, atol=FLOAT64_REL * max(scale, 1e-300), name=name)
    err = rel_error(actual, expected)
    assert err <= FLOAT64_REL, f"[{name}] relative error {err:.3e} > {FLOAT64_REL:g}"


def assert_grads_present(grads, ffn: FFN) -> None:
    """A gradient exists exactly for each input that exists, with its shape and dtype."""
    for name, inp in zip(GRAD_NAMES, ffn.args()):
        g = getattr(grads, name)
        if inp is None:
            assert g is None, f"{name} must be None when its input is None"
        else:
            assert g is not None, f"{name} missing"
            assert g.shape == inp.shape and g.dtype == inp.dtype, f"{name}: {g.shape}/{g.dtype} vs {inp.shape}/{inp.dtype}"


# ---------------------------------------------------------------------------------------------
# gate_pack_ref
# ---------------------------------------------------------------------------------------------


@given(ffn_configs())
def test_gate_pack_ref_packs_the_gate_in_the_accumulation_dtype(cfg: FFNConfig):
    ffn = cfg.build()
    acc = accumulation_dtype(ffn.dtype)
    w, b = (ffn.wg, ffn.bg) if ffn.gated else (ffn.wu, ffn.bu)
    packed = gate_pack_ref(ffn.x, w, b, cfg.layout)
    pre = ffn.x.to(acc) @ w.to(acc).T  # the dense gate in the accumulation dtype
    if b is not None:
        pre = pre + b.to(acc)
    expected = pack_ref(pre, cfg.layout)
    assert packed.val.dtype == acc
    assert torch.equal(packed.count, expected.count)
    stored = expected.stored_mask()
    assert torch.equal(packed.stored_mask(), stored)
    assert torch.equal(packed.idx[stored], expected.idx[stored])
    assert_close_verbose(packed.val[stored], expected.val[stored], rtol=1e-6 if acc == torch.float32 else 1e-13, atol=1e-6, name="val")


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@given(ffn_configs(dtypes=(F64,)))
def test_forward_float64_matches_dense(cfg: FFNConfig):
    ffn = cfg.build()
    m, d = ffn.x.shape
    r = forward(ffn, cfg.layout)
    ref = dense_ffn_ref(*ffn.args())
    assert r.out.shape == (m, d) and r.out.dtype == F64
    assert_float64_close(r.out, ref, "out")
    assert_close_verbose(r.l1, dense_l1(ffn), rtol=1e-12, atol=1e-300, name="l1")

    # Bookkeeping the lowering relies on.
    assert torch.equal(r.dense_rows, dense_rows_ref(*ffn.args(), r.packed))
    assert bool((r.dense_rows | ~r.packed.overflow_rows()).all()), "every overflow row must go dense"
    assert torch.equal(r.packed.count, gate_pack_ref(ffn.x, ffn.wg if ffn.gated else ffn.wu, ffn.bg if ffn.gated else ffn.bu, cfg.layout).count)
    if ffn.gated:
        # up_val holds x_t · Wu_j + bu_j at every stored slot of a sparse row.
        where = r.packed.stored_mask() & ~r.dense_rows.view(-1, 1, 1)
        m_i, _, _ = where.nonzero(as_tuple=True)
        up = torch.nn.functional.linear(ffn.x, ffn.wu, ffn.bu)
        assert_close_verbose(r.up_val[where], up[m_i, r.packed.idx[where].long()], rtol=1e-12, atol=1e-13, name="up_val")
    if cfg.hot_rows:
        hot = list(cfg.hot_rows)
        assert bool(r.packed.count[hot].sum(1).eq(cfg.h).all()), "hot rows are active in every neuron"


def _check_accuracy(cfg: FFNConfig):
    ffn = cfg.build()
    ffn64 = ffn.double()
    ref = dense_ffn_ref(*ffn64.args())
    r = forward(ffn, cfg.layout)
    assert r.out.dtype == ffn.dtype
    err_sparse = rel_error(r.out, ref)  # a NaN/Inf where the float64 result is finite fails here
    err_dense = rel_error(dense_ffn_ref(*ffn.args()), ref, nan_mismatch="inf")
    bound = ACCURACY_SLACK * err_dense + tiny(ffn.dtype) * condition(ffn64)
    assert err_sparse <= bound, (
        f"{ffn.dtype}: sparse rel. error {err_sparse:.3e} > {ACCURACY_SLACK} × dense {err_dense:.3e} + tiny × condition "
        f"(ratio {err_sparse / err_dense if err_dense else math.inf:.2f})"
    )
    # L1 comes back in the accumulation dtype: compare with the float64 L1 of the same inputs.
    assert r.l1.dtype == accumulation_dtype(ffn.dtype)
    assert_close_verbose(r.l1, dense_l1(ffn64), rtol=2e-5, atol=1e-30, name="l1")


@given(ffn_configs(dtypes=(torch.float16, torch.bfloat16)))
def test_forward_half_precision_no_less_accurate_than_dense(cfg: FFNConfig):
    _check_accuracy(cfg)


@given(ffn_configs(dtypes=(torch.float32,)))
def test_forward_float32_no_less_accurate_than_dense(cfg: FFNConfig):
    _check_accuracy(cfg)


def test_forward_float32_accuracy_minimal():
    """Hypothesis' shrunk float32 counterexample: one token, plain FFN, 16 active neurons. The
    reference accumulates float32 inputs in float32 (``accumulation_dtype``), so "rounds once, at
    the output" buys nothing and its summation order is 1.26× less accurate than dense here."""
    _check_accuracy(FFNConfig(m=1, d=2, h=16, density=1.0, gated=False, bias=True, dtype=torch.float32, seed=0))


@pytest.mark.parametrize("gated", [True, False])
def test_forward_fast_path_pinned_to_dense_path(gated):
    """The same FFN through an all-sparse layout (one column per tile: never overflows), the
    default one, and a layout where nearly every row overflows (dense backup) agrees in float64."""
    ffn = make_ffn(37, 19, 300, density=0.3, gated=gated, dtype=F64, seed=3, hot_rows=(4, 5))
    ref = dense_ffn_ref(*ffn.args())
    for layout, expect_dense in [(TwellLayout(1, 1), False), (DEFAULT_LAYOUT, None), (TwellLayout(512, 1), True)]:
        r = forward(ffn, layout)
        if expect_dense is not None:
            assert bool((r.dense_rows == expect_dense).all()), f"{layout}: dense_rows {r.dense_rows.tolist()}"
        assert_float64_close(r.out, ref, f"out with {layout}")
        assert_close_verbose(r.l1, dense_l1(ffn), rtol=1e-12, atol=0, name=f"l1 with {layout}")


def test_forward_empty_batch():
    for gated in (True, False):
        ffn = make_ffn(0, 5, 200, gated=gated, dtype=torch.float32)
        r = forward(ffn)
        assert r.out.shape == (0, 5) and r.dense_rows.shape == (0,)
        assert r.l1.item() == 0.0


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


@given(ffn_configs(dtypes=(F64,)), L1_SCALES)
def test_backward_float64_matches_autograd(cfg: FFNConfig, l1_scale: float):
    ffn = cfg.build()
    dout = random_dout(ffn, cfg.seed)
    _, grads = backward(ffn, dout, l1_scale, cfg.layout)
    _, ref = dense_grads(ffn, dout, l1_scale)
    assert_grads_present(grads, ffn)
    for name in GRAD_NAMES:
        if ref[name] is not None:
            assert_float64_close(getattr(grads, name), ref[name], name)


@given(ffn_configs(dtypes=(F64,), min_m=1))
def test_backward_l1_term_alone(cfg: FFNConfig):
    """With ``dout = 0`` only the L1 term is left: ``l1_scale = 0`` gives exactly zero gradients
    (the regularizer is off exactly), and ``l1_scale = s`` gives ``s · ∂L1/∂θ``."""
    ffn = cfg.build()
    zeros = torch.zeros_like(ffn.x[:, :1].expand(-1, ffn.wd.shape[0])).contiguous()
    _, off = backward(ffn, zeros, 0.0, cfg.layout)
    for name in GRAD_NAMES:
        g = getattr(off, name)
        if g is not None:
            assert bool((g == 0).all()), f"{name} must be exactly 0 with dout = 0 and l1_scale = 0; max |g| = {g.abs().max()}"
    _, on = backward(ffn, zeros, 2.5, cfg.layout)
    _, ref = dense_grads(ffn, zeros, 2.5)
    for name in GRAD_NAMES:
        if ref[name] is not None:
            assert_float64_close(getattr(on, name), ref[name], f"{name} (L1 only)")


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("hot", ["none", "some", "all"])
def test_backward_overflow_heavy_rows(gated, bias, hot):
    """Rows active in every neuron overflow every full tile and take the dense backup."""
    m = 12
    hot_rows = {"none": (), "some": (0, 5, 11), "all": tuple(range(m))}[hot]
    ffn = make_ffn(m, 9, 260, density=0.02, gated=gated, bias=bias, dtype=F64, seed=11, hot_rows=hot_rows)
    dout = random_dout(ffn, 11)
    fwd, grads = backward(ffn, dout, 0.7)
    assert fwd.dense_rows.nonzero().flatten().tolist() == list(hot_rows)
    _, ref = dense_grads(ffn, dout, 0.7)
    assert_float64_close(fwd.out, dense_ffn_ref(*ffn.args()), "out")
    for name in GRAD_NAMES:
        if ref[name] is not None:
            assert_float64_close(getattr(grads, name), ref[name], name)


def _check_backward_accuracy(cfg: FFNConfig, l1_scale: float):
    ffn = cfg.build()
    dout = random_dout(ffn, cfg.seed)
    _, grads = backward(ffn, dout, l1_scale, cfg.layout)
    _, ref = dense_grads(ffn.double(), dout.double(), l1_scale)
    _, base = dense_grads(ffn, dout, l1_scale)
    conditions = grad_conditions(ffn.double(), dout.double(), l1_scale, ref)
    assert_grads_present(grads, ffn)
    for name in GRAD_NAMES:
        if ref[name] is None:
            continue
        err_sparse = rel_error(getattr(grads, name), ref[name])
        err_dense = rel_error(base[name], ref[name], nan_mismatch="inf")
        bound = ACCURACY_SLACK * err_dense + tiny(ffn.dtype) * conditions[name]
        assert err_sparse <= bound, (
            f"{name} ({ffn.dtype}): sparse rel. error {err_sparse:.3e} > {ACCURACY_SLACK} × dense {err_dense:.3e} "
            f"+ tiny × condition {conditions[name]:.3g}"
        )


@given(ffn_configs(dtypes=(torch.float16, torch.bfloat16)), L1_SCALES)
def test_backward_half_precision_no_less_accurate_than_dense(cfg: FFNConfig, l1_scale: float):
    _check_backward_accuracy(cfg, l1_scale)


@given(ffn_configs(dtypes=(torch.float32,)), L1_SCALES)
def test_backward_float32_no_less_accurate_than_dense(cfg: FFNConfig, l1_scale: float):
    _check_backward_accuracy(cfg, l1_scale)


def test_backward_float32_accuracy_minimal():
    """Hypothesis' shrunk float32 counterexample: one token, plain FFN, two active neurons; dx is
    1.24× less accurate than dense float32 autograd (float32 accumulation, see the forward one)."""
    _check_backward_accuracy(FFNConfig(m=1, d=16, h=2, density=1.0, gated=False, bias=False, dtype=torch.float32, seed=0), 0.0)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_tiles_at_and_over_capacity(gated, bias, dtype):
    """Exact active sets: a tile row with 16 actives (capacity) stays sparse, 17 goes dense;
    likewise in the partial last tile; all-zero and all-active rows. Forward and backward match
    float64 dense; float32 within float32 rounding."""
    h = 300  # tiles of 128, 128, 44
    active = torch.zeros(8, h, dtype=torch.bool)
    active[0, 0:16] = True  # tile 0 exactly at capacity
    active[1, 0:17] = True  # tile 0 one over
    active[2, 112:128] = active[2, 128:144] = True  # two tiles at capacity, touching the edge
    active[3, 256:273] = True  # partial last tile one over
    active[4, 284:300] = True  # partial last tile at capacity
    active[6] = True  # all active
    active[7, ::8] = True  # 16 per full tile, 6 in the last: at capacity everywhere
    ffn = make_ffn_with_pattern(active, gated=gated, bias=bias, dtype=dtype, seed=1)
    dout = random_dout(ffn, 3)
    fwd, grads = backward(ffn, dout, 0.25)
    assert fwd.packed.count.tolist()[0] == [16, 0, 0] and fwd.packed.count.tolist()[1] == [17, 0, 0]
    assert fwd.dense_rows.tolist() == [False, True, False, True, False, False, True, False]
    out64, ref = dense_grads(ffn.double(), dout.double(), 0.25)
    close = assert_float64_close if dtype == F64 else (lambda a, e, n: assert_close_verbose(a, e, rtol=1e-5, atol=1e-5, name=n))
    close(fwd.out, out64, "out")
    assert_close_verbose(fwd.l1, dense_l1(ffn.double()), rtol=1e-6, atol=0, name="l1")
    for name in GRAD_NAMES:
        if ref[name] is not None:
            close(getattr(grads, name), ref[name], name)


# ---------------------------------------------------------------------------------------------
# NaN / Inf semantics: exactly dense PyTorch's pattern in the same dtype
# ---------------------------------------------------------------------------------------------


def _check_matches_dense(ffn: FFN, l1_scale: float, *, fwd=None, grads=None, dout=None, finite_rtol=None):
    """Output, L1 and every gradient: the NaN and ±Inf masks of dense autograd in the same
    dtype, and close finite values."""
    dout = random_dout(ffn, 7) if dout is None else dout
    if fwd is None:
        fwd, grads = backward(ffn, dout, l1_scale)
    out_ref, ref = dense_grads(ffn, dout, l1_scale)
    rtol = finite_rtol or (1e-9 if ffn.dtype == F64 else 1e-4)

    def check(actual, expected, name):
        assert_same_nonfinite(actual, expected, name)
        finite = torch.isfinite(expected)
        scale = expected[finite].abs().max().item() if finite.any() else 1.0
        assert_close_verbose(actual[finite], expected[finite], rtol=rtol, atol=rtol * scale, name=name)

    check(fwd.out, out_ref, "out")
    l1_ref = dense_l1(ffn)
    assert fwd.l1.isnan().item() == l1_ref.isnan().item(), f"l1 {fwd.l1.item()} vs dense {l1_ref.item()}"
    for name in GRAD_NAMES:
        if ref[name] is not None:
            check(getattr(grads, name), ref[name], name)
    return fwd


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("feature", ["constant", "random"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("l1_scale", [0.0, 0.5])
def test_nonfinite_x_entry(value, feature, gated, dtype, l1_scale):
    ffn = make_ffn(9, 6, 140, density=0.05, gated=gated, bias=True, dtype=dtype, seed=5)
    # Feature 0 is the constant one: with a gate bias its gate weight column is 0, so 0 · Inf = NaN.
    ffn.x[3, 0 if feature == "constant" else 4] = value
    fwd = _check_matches_dense(ffn, l1_scale)
    expected = fwd.packed.overflow_rows().clone()
    expected[3] = True
    assert torch.equal(fwd.dense_rows, expected), "only the non-finite row (and overflow rows) go dense"


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize(
    ("gated", "which"),
    [(True, w) for w in ("wg", "wu", "wd", "bg", "bu", "bd")] + [(False, w) for w in ("wu", "wd", "bu", "bd")],
)
@pytest.mark.parametrize("l1_scale", [0.0, 0.5])
def test_nonfinite_weight_entry_routes_every_row_dense(value, gated, which, l1_scale):
    ffn = make_ffn(9, 6, 140, density=0.05, gated=gated, bias=True, dtype=torch.float32, seed=6)
    t = getattr(ffn, which)
    t.view(-1)[min(7, t.numel() - 1)] = value
    fwd = _check_matches_dense(ffn, l1_scale)
    assert bool(fwd.dense_rows.all()), "a non-finite weight or bias must route every row dense"


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("l1_scale", [0.0, 0.5])
def test_infinite_gate_from_finite_inputs_on_the_sparse_path(sign, l1_scale):
    """A gate pre-activation that overflows to ``±Inf`` while x and the weights are finite: the
    only way a packed ±Inf reaches a *sparse* row (nothing is non-finite and the up bound is
    small). +Inf must propagate like dense (``Inf · up``), -Inf must be inactive (``0 · up``).

    Built in float64 (1e150 · 1e160 overflows float64), so it holds whatever the accumulation
    dtype of lower precisions is. (A NaN gate from finite inputs, ``Inf − Inf``, is left out on
    purpose: whether a dot product that overflows both ways gives NaN or Inf depends on the BLAS
    kernel's summation order; dense PyTorch itself disagrees between ``F.linear`` and
    ``x @ w.T + b`` on it.)"""
    ffn = make_ffn(6, 8, 40, density=0.1, gated=True, bias=True, dtype=F64, seed=9)
    ffn.x[2, 1] = ffn.x[2, 6] = 1e150  # squares stay finite, so the row's norm (the guard) does too
    ffn.wg[:, [1, 6]] = 0.0  # only neuron 13 sees the huge features
    ffn.wu[:, [1, 6]] = 0.0  # so up stays finite and small
    ffn.wg[13, 1] = ffn.wg[13, 6] = sign * 1e160
    gate = torch.nn.functional.linear(ffn.x, ffn.wg, ffn.bg)
    assert gate[2, 13].item() == sign * INF, "construction must overflow the gate"
    fwd = _check_matches_dense(ffn, l1_scale)
    assert not fwd.dense_rows[2], "the infinite gate must be exercised on the sparse path"
    assert fwd.packed.count[2, 0] > 0


def assert_same_nan_mask(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Only the NaN masks (float16 overflow may turn finite values into Inf on either side)."""
    a, e = actual.isnan(), expected.isnan()
    if not torch.equal(a, e):
        where = (a != e).nonzero()[:6].tolist()
        shown = ", ".join(f"{tuple(i)}: actual={actual[tuple(i)].item()!r} expected={expected[tuple(i)].item()!r}" for i in where)
        raise AssertionError(
            f"[{name}] NaN mask differs from dense {expected.dtype} PyTorch at {int((a != e).sum())} element(s) "
            f"(actual {int(a.sum())} NaN, dense {int(e.sum())} NaN): {shown}"
        )


def _fp16_up_overflow_ffn() -> tuple[FFN, int]:
    """float16 gated FFN whose row 2 has a negative gate everywhere but an up projection past
    float16's max: dense PyTorch computes relu(gate) · up = 0 · Inf = NaN there."""
    gen = torch.Generator().manual_seed(0)
    m, d, h = 5, 8, 20
    x = torch.randn(m, d, generator=gen)
    wg = -torch.rand(h, d, generator=gen) / d  # row 2 (positive x) sees gate < 0 everywhere
    wu = (torch.rand(h, d, generator=gen) + 0.5) / math.sqrt(d)
    wd = torch.randn(d, h, generator=gen) / math.sqrt(h)
    x[2] = 3e4
    ffn = FFN(x, wg, wu, wd, None, None, 0.1 * torch.randn(d, generator=gen)).to(torch.float16)
    up = torch.nn.functional.linear(ffn.x, ffn.wu)
    gate = torch.nn.functional.linear(ffn.x, ffn.wg)
    assert bool((gate[2] <= 0).all()) and bool(up[2].isinf().any()), "construction"
    assert bool(dense_ffn_ref(*ffn.args())[2].isnan().all())
    return ffn, 2


def test_fp16_up_overflow_with_inactive_gate_forward():
    ffn, row = _fp16_up_overflow_ffn()
    r = forward(ffn)
    assert r.dense_rows[row], "the up-overflow guard must flag the row"
    assert_same_nan_mask(r.out, dense_ffn_ref(*ffn.args()), "out")


def test_fp16_up_overflow_with_inactive_gate_backward():
    ffn, row = _fp16_up_overflow_ffn()
    dout = random_dout(ffn, 1)
    _, grads = backward(ffn, dout, 0.0)
    _, ref = dense_grads(ffn, dout, 0.0)
    for name in GRAD_NAMES:
        if ref[name] is not None:
            assert_same_nan_mask(getattr(grads, name), ref[name], name)


def test_fp16_dout_overflow_backward():
    """float16 ``dh = dout · Wd`` past float16's max on one row: dense autograd multiplies that
    Inf by relu(gate) = 0 for every inactive neuron, giving NaN in dx and dWu."""
    ffn = make_ffn(4, 8, 16, density=0.3, gated=True, bias=True, dtype=torch.float16, seed=1)
    dout = random_dout(ffn, 1)
    dout[2] = 6e4
    fwd, grads = backward(ffn, dout, 0.0)
    assert backward_dense_rows_ref(dout, *ffn.args(), fwd.packed)[2], "the dout guard must flag the row"
    _, ref = dense_grads(ffn, dout, 0.0)
    assert bool(ref["dx"][2].isnan().any()), "construction"
    for name in GRAD_NAMES:
        if ref[name] is not None:
            assert_same_nan_mask(getattr(grads, name), ref[name], name)


def test_nonfinite_dout_row():
    """A non-finite dout row goes dense in backward only; grads match dense autograd's pattern."""
    for gated in (True, False):
        ffn = make_ffn(7, 5, 150, density=0.01, gated=gated, dtype=torch.float32, seed=4)
        dout = random_dout(ffn, 2)
        dout[1, 3], dout[4, 0] = NAN, INF
        fwd, grads = backward(ffn, dout, 0.5)
        assert not fwd.dense_rows.any()
        rows = backward_dense_rows_ref(dout, *ffn.args(), fwd.packed)
        assert rows.nonzero().flatten().tolist() == [1, 4]
        _check_matches_dense(ffn, 0.5, fwd=fwd, grads=grads, dout=dout)


# ---------------------------------------------------------------------------------------------
# Dense-row guards
# ---------------------------------------------------------------------------------------------


def test_dense_rows_ref_flags():
    ffn = make_ffn(8, 6, 200, density=0.02, gated=True, dtype=torch.float32, seed=2, hot_rows=(5,))
    packed = forward(ffn).packed
    assert dense_rows_ref(*ffn.args(), packed).nonzero().flatten().tolist() == [5]  # overflow only
    for value in (NAN, INF, -INF):
        bad = ffn.clone()
        bad.x[1, 2] = value
        packed = forward(bad).packed
        assert dense_rows_ref(*bad.args(), packed).nonzero().flatten().tolist() == [1, 5]
    for which in ("wg", "wu", "wd", "bg", "bu", "bd"):
        bad = ffn.clone()
        getattr(bad, which).view(-1)[0] = NAN
        assert bool(dense_rows_ref(*bad.args(), packed).all()), which
    empty = make_ffn(0, 6, 200, dtype=torch.float32)
    assert dense_rows_ref(*empty.args(), forward(empty).packed).shape == (0,)
    assert backward_dense_rows_ref(torch.zeros(0, 6), *empty.args(), forward(empty).packed).shape == (0,)


@given(ffn_configs(dtypes=(torch.float16,), min_m=1, custom_layouts=False, hot=False), st.data())
def test_overflow_guards_are_sound(cfg: FFNConfig, data):
    """float16, gated: a row left on the sparse path never overflows ``up`` (forward) or
    ``dh = dout · Wd`` (backward) in dense float16 PyTorch. Random rows are blown up to provoke it."""
    ffn = dataclasses.replace(cfg, gated=True).build()
    m = ffn.x.shape[0]
    scales = torch.tensor(data.draw(st.lists(st.sampled_from([1.0, 1e2, 1e3, 3e3, 1e4, 6e4]), min_size=m, max_size=m)))
    x = (ffn.x.float() * scales[:, None]).clamp(-6e4, 6e4).half()
    ffn = ffn.with_(x=x)
    dout = (random_dout(ffn, cfg.seed).float() * scales.flip(0)[:, None]).clamp(-6e4, 6e4).half()
    packed = forward(ffn).packed
    fwd_rows = dense_rows_ref(*ffn.args(), packed)
    up = torch.nn.functional.linear(ffn.x, ffn.wu, ffn.bu)
    assert bool(torch.isfinite(up[~fwd_rows]).all()), "a sparse row overflowed up in float16"
    bwd_rows = backward_dense_rows_ref(dout, *ffn.args(), packed)
    assert bool((bwd_rows | ~fwd_rows).all()), "backward dense rows must include the forward's"
    dh = dout @ ffn.wd
    assert bool(torch.isfinite(dh[~bwd_rows]).all()), "a sparse row overflowed dh in float16"
