"""The Triton TwELL backward (kernels/sparse_ffn_bwd.py and the kernels it launches) against its
reference and dense PyTorch.

Oracles:

* ``reference.ffn_backward_ref`` on the same inputs, every gradient, up to fp32 summation order
  (fp32) or one rounding flip of the output (fp16); NaN/Inf patterns exactly;
* the fast path pinned to the general one: the same call with every row flagged dense;
* on GPU (``-m gpu``): float64 autograd of ``(out · dout).sum() + l1_scale · (1/M) Σ|h|`` at the
  benchmark shape, no worse than dense bf16 autograd; CUDA-graph capture; no host sync;
  run-to-run determinism.

On CPU the kernels run under ``TRITON_INTERPRET=1`` on tiny shapes (M ≤ 32, D ≤ 40, H ≤ 300); the
interpreter costs ~5 ms per program of the weight-gradient kernel (one per neuron × D slice), which
is what bounds these sizes.
"""

from __future__ import annotations

import importlib
import math
import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.strategies import EDGE_H, densities, sizes  # noqa: E402
from tests.utils import (FFN, GRAD_NAMES, assert_close_verbose, dense_grads, gate_threshold, grad_magnitudes,  # noqa: E402
                         make_ffn, make_ffn_with_pattern, rel_error)
from twell_compile.kernels import reference as R  # noqa: E402
from twell_compile.kernels.sparse_ffn_bwd import backward_dense_rows, sparse_ffn_backward  # noqa: E402
from twell_compile.kernels.wgrad import HOT_SPLIT_MIN  # noqa: E402

PW = importlib.import_module("twell_compile.kernels.pair_walk")  # the module itself: tests patch its switches
from twell_compile.kernels.format import DEFAULT_LAYOUT, TwellLayout, TwellPacked, empty_packed, is_paired  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Parity with the reference. fp32: summation order only. 16-bit: the fp32 results may round to
# the neighbouring value (one ulp, < 2^-10 relative for fp16, 2^-7 for bf16).
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}  # × max |expected|
SPECIALS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-30, 1e30)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _dout(m: int, d: int, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 7)
    return torch.randn(m, d, generator=gen, dtype=torch.float64).to(dtype).to(DEV)


def _on(ffn: FFN, device) -> FFN:
    return FFN(*(None if t is None else t.to(device) for t in ffn.args()))


def _forward(ffn: FFN, layout: TwellLayout = DEFAULT_LAYOUT):
    res = R.ffn_forward_ref(*ffn.args(), layout=layout)
    return res.packed, res.up_val


def _grads(ffn, dout, packed, up_val, l1, *, layout=DEFAULT_LAYOUT, dense_rows=None, scratch=None, gemm=False):
    if dense_rows is None:
        dense_rows = R.backward_dense_rows_ref(dout, *ffn.args(), packed)
    l1t = torch.tensor(float(l1), device=dout.device)
    return sparse_ffn_backward(dout, *ffn.args(), packed, up_val, dense_rows, l1t, layout=layout,
                                 dense_scratch_rows=scratch, dense_wgrad_gemm=gemm)


def _reference(ffn, dout, packed, up_val, l1):
    return R.ffn_backward_ref(dout, *ffn.args(), packed, up_val, torch.tensor(float(l1), device=dout.device))


def assert_grads_close(got: R.Grads, ref: R.Grads, dtype, label: str = "", magnitudes: "R.Grads | None" = None) -> None:
    """``got`` against ``ref`` at the dtype's tolerances, × the largest finite expected value.
    ``magnitudes`` (``tests.utils.grad_magnitudes``) adds the rounding bound ``n · u · Σ|terms|`` to each finite
    element's tolerance (``u`` the unit roundoff, ``n`` the roundings of the longest chain: D for
    ``dh``, then two per pair of a neuron): where a huge value multiplies a sum that cancels, the
    summation order decides the result to that much, whichever order the kernel and the reference
    take."""
    for name, a, e, mag in zip(GRAD_NAMES, got, ref, magnitudes or (None,) * len(GRAD_NAMES)):
        if e is None:
            assert a is None, f"{label}{name}: expected None, got a tensor"
            continue
        assert a is not None, f"{label}{name}: missing"
        assert a.dtype == e.dtype and a.shape == e.shape, f"{label}{name}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        finite = e[torch.isfinite(e)].double().abs()
        scale = finite.max().item() if finite.numel() else 1.0
        atol = ATOL[dtype] * max(scale, 1e-30)
        if mag is not None:
            d, h = ref.dx.shape[1], ref.dwu.shape[0]
            rounding = (d + 2 * h + 2) * torch.finfo(dtype).eps / 2 * mag.double().cpu()
            atol = atol + torch.where(torch.isfinite(rounding), rounding, torch.zeros_like(rounding))
        assert_close_verbose(a, e, rtol=RTOL[dtype], atol=atol, name=label + name)


def _stored_sparse(packed: TwellPacked, dense_rows: torch.Tensor) -> torch.Tensor:
    return packed.stored_mask() & ~dense_rows.view(-1, 1, 1)


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


def _layouts():
    # Mostly the default; small tiles make multi-tile rows and overflow (dense rows) frequent.
    small = st.builds(lambda t, f: TwellLayout(tile_n=t, slots=max(1, round(f * t))),
                      st.sampled_from([8, 16, 32, 64]), st.floats(0.05, 1.0))
    return st.one_of(st.just(DEFAULT_LAYOUT), st.just(DEFAULT_LAYOUT), small)


@st.composite
def cases(draw, dtypes=(torch.float32, torch.float16)):
    m = draw(sizes(1, 32, (1, 2, 17, 32)))
    d = draw(sizes(1, 32, (1, 2, 16, 31, 32)))  # D = 40 (two D slices) in the explicit tests
    h = draw(sizes(1, 300, EDGE_H + (300,)))
    hot = ()
    if d >= 2 and draw(st.integers(0, 3)) == 0:
        hot = tuple(sorted(draw(st.sets(st.integers(0, m - 1), min_size=1, max_size=min(m, 3)))))
    return dict(
        m=m, d=d, h=h, density=draw(densities()), gated=draw(st.booleans()), bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtypes)), skew=draw(st.sampled_from([0.0, 0.0, 3.0])), hot_rows=hot,
        seed=draw(st.integers(0, 2**31 - 1)),
    ), draw(_layouts()), draw(st.sampled_from([0.0, 0.0, 0.5, 7.0])), draw(st.sampled_from([None, None, 0, 16]))


# ---------------------------------------------------------------------------------------------
# Parity with the reference
# ---------------------------------------------------------------------------------------------


@given(case=cases(), gemm=st.booleans())
def test_matches_reference(case, gemm):
    """Every gradient, for drawn shapes, densities 0..100 %, gated/plain, biases, L1 on/off,
    fp32/fp16, skewed neurons, all-active (overflowing → dense) rows and small layouts, with the
    dense rows' weight gradients gathered per neuron or summed as GEMMs."""
    kwargs, layout, l1, scratch = case
    ffn = _on(make_ffn(**kwargs), DEV)
    dout = _dout(kwargs["m"], kwargs["d"], kwargs["dtype"], kwargs["seed"])
    packed, up_val = _forward(ffn, layout)
    got = _grads(ffn, dout, packed, up_val, l1, layout=layout, scratch=scratch, gemm=gemm)
    ref = R.ffn_backward_ref(dout, *ffn.args(), packed, up_val, torch.tensor(l1, device=DEV))
    assert_grads_close(got, ref, kwargs["dtype"])


def _grads_bitwise_as_when(switch: str, value, *args, **kwargs) -> R.Grads:
    """``_grads(*args, **kwargs)``, checked bitwise equal to the same call with the pair loops'
    switch ``pair_walk.<switch>`` set to ``value``."""
    default = _grads(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PW, switch, value)
        switched = _grads(*args, **kwargs)
    for a, b in zip(default, switched):
        assert (a is None and b is None) or torch.equal(a, b), f"{switch}={value} changed the gradients"
    return default


@pytest.mark.parametrize("gated", [True, False])
def test_tile_by_tile_walk_matches_the_bit_set_walk(gated):
    """Rows of more than 64 tiles walk them one by one (no bit set); forced here on small H, the
    gradients equal the default walk's bitwise."""
    ffn = _on(make_ffn(12, 24, 300, density=0.05, gated=gated, bias=True, skew=1.0, seed=5), DEV)
    dout = _dout(12, 24, torch.float32, 5)
    layout = TwellLayout(tile_n=16, slots=4)  # 19 tiles, some overflowed
    packed, up_val = _forward(ffn, layout)
    bits = _grads_bitwise_as_when("MAX_BIT_TILES", 0, ffn, dout, packed, up_val, 0.5, layout=layout)
    assert_grads_close(bits, _reference(ffn, dout, packed, up_val, 0.5), torch.float32)


@pytest.mark.parametrize("gated", [True, False])
def test_paired_slots_give_the_same_gradients(gated):
    """The backward takes two buffers; a paired TwELL buffer (``gate_pack``'s default, what a user
    of the kernels may pass) is made contiguous first: the same gradients, bitwise."""
    ffn = _on(make_ffn(14, 24, 300, density=0.05, gated=gated, bias=True, skew=1.0, seed=6), DEV)
    dout = _dout(14, 24, torch.float32, 6)
    packed, up_val = _forward(ffn)
    paired = empty_packed(14, 300, torch.float32, DEV, paired=True)
    for dst, src in zip(paired, packed):
        dst.copy_(src)
    assert is_paired(paired)
    for a, b in zip(_grads(ffn, dout, packed, up_val, 0.5), _grads(ffn, dout, paired, up_val, 0.5)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("gated", [True, False])
def test_bf16_rows_read_as_pairs(gated):
    """bf16 rows read as int32 pairs (``pair_walk.paired``) by the tokens and weight-gradient
    kernels: the reference's gradients, and bitwise the element-wise reads' ones. D spans two of
    the weight-gradient kernel's D slices. No dense row (their bf16 ``tl.dot`` does not run in the
    interpreter)."""
    ffn = _on(make_ffn(16, 40, 260, density=0.04, gated=gated, bias=True, skew=1.0, seed=3,
                       dtype=torch.bfloat16), DEV)
    dout = _dout(16, 40, torch.bfloat16, 3)
    packed, up_val = _forward(ffn)
    dense_rows = R.backward_dense_rows_ref(dout, *ffn.args(), packed)
    assert not dense_rows.any()
    pairs = _grads_bitwise_as_when("PAIR_READS", False, ffn, dout, packed, up_val, 0.5, dense_rows=dense_rows)
    assert_grads_close(pairs, _reference(ffn, dout, packed, up_val, 0.5), torch.bfloat16)


@pytest.mark.parametrize("gated", [True, False])
def test_several_d_blocks_and_tiles(gated):
    """D spans two D slices of the weight-gradient kernel (interpreter: 32 wide) and H three tiles."""
    ffn = _on(make_ffn(16, 40, 260, density=0.04, gated=gated, bias=True, skew=1.0, seed=3), DEV)
    dout = _dout(16, 40, torch.float32, 3)
    packed, up_val = _forward(ffn)
    assert_grads_close(_grads(ffn, dout, packed, up_val, 0.5), _reference(ffn, dout, packed, up_val, 0.5), torch.float32)


@pytest.mark.parametrize("gated", [True, False])
def test_fast_path_pinned_to_dense_rows(gated):
    """With finite data the dense formulas give the sparse answer: flag every row dense and compare
    with the sparse call (and both with the reference)."""
    ffn = _on(make_ffn(18, 24, 90, density=0.08, gated=gated, bias=True, seed=11), DEV)
    dout = _dout(18, 24, torch.float32, 11)
    packed, up_val = _forward(ffn)
    ref = _reference(ffn, dout, packed, up_val, 0.5)
    sparse = _grads(ffn, dout, packed, up_val, 0.5)
    assert int(R.backward_dense_rows_ref(dout, *ffn.args(), packed).sum()) == 0
    all_dense = torch.ones(18, dtype=torch.bool, device=DEV)
    # scratch coefficients (weight gradients gathered per neuron, or as GEMMs), and recomputation
    # past the scratch
    for scratch, gemm in ((None, False), (None, True), (0, False), (0, True)):
        dense = _grads(ffn, dout, packed, up_val, 0.5, dense_rows=all_dense, scratch=scratch, gemm=gemm)
        assert_grads_close(dense, sparse, torch.float32, label=f"scratch={scratch} gemm={gemm} ")
    assert_grads_close(sparse, ref, torch.float32)


@pytest.mark.parametrize("gemm", [False, True])
@pytest.mark.parametrize("scratch", [None, 16, 0])
def test_many_dense_rows_across_the_scratch_boundary(scratch, gemm):
    """20 overflowing rows (all-active) and 4 sparse ones: dense rows split between the scratch
    (list positions < 16) and recomputation, in every kernel; the scratch rows' weight gradients
    gathered per neuron or summed as GEMMs."""
    hot = tuple(r for r in range(24) if r % 6 != 5)
    ffn = _on(make_ffn(24, 20, 140, density=0.03, gated=True, bias=True, hot_rows=hot, seed=5), DEV)
    dout = _dout(24, 20, torch.float32, 5)
    packed, up_val = _forward(ffn)
    assert int(R.backward_dense_rows_ref(dout, *ffn.args(), packed).sum()) == 20
    got = _grads(ffn, dout, packed, up_val, 0.5, scratch=scratch, gemm=gemm)
    assert_grads_close(got, _reference(ffn, dout, packed, up_val, 0.5), torch.float32)


@pytest.mark.parametrize("gemm", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_hottest_neurons_split_over_programs(gated, gemm):
    """The weight-gradient kernel splits the hottest neurons' pairs over several programs (in the
    interpreter: the 3 hottest, 3 segments each, from 2 pairs) and sums the segments' partials in
    one program per D slice (D = 41: two slices, the second partial): neurons active on 19, 11 and
    5 of 40 tokens, one with a single pair, sparse others, and two all-active rows computed densely
    (segment 0 adds their share)."""
    m, h = 40, 40
    gen = torch.Generator().manual_seed(9)
    active = torch.rand(m, h, generator=gen) < 0.06
    for j, n in ((7, 19), (30, 11), (12, 5)):
        active[:, j] = False
        active[torch.randperm(m, generator=gen)[:n], j] = True
    active[:, 21] = False
    active[3, 21] = True
    active[[4, 17]] = True  # all-active rows: their tiles overflow, so they are computed densely
    ffn = _on(make_ffn_with_pattern(active, gated=gated, bias=True, seed=9), DEV)
    dout = _dout(m, m + 1, torch.float32, 9)
    packed, up_val = _forward(ffn)
    dense_rows = R.backward_dense_rows_ref(dout, *ffn.args(), packed)
    assert dense_rows.nonzero().flatten().tolist() == [4, 17]
    got = _grads(ffn, dout, packed, up_val, 0.5, dense_rows=dense_rows, gemm=gemm)
    assert_grads_close(got, _reference(ffn, dout, packed, up_val, 0.5), torch.float32)


@pytest.mark.parametrize("gated", [True, False])
def test_dense_rows_dx_over_several_h_splits(gated):
    """H = 600 spans three H splits of the scratch dx kernel (the last one partial), with 18 dense
    rows (two 16-row blocks of the list) and sparse rows between them."""
    hot = tuple(r for r in range(24) if r % 4 != 1)
    ffn = _on(make_ffn(24, 20, 600, density=0.02, gated=gated, bias=True, hot_rows=hot, seed=9), DEV)
    dout = _dout(24, 20, torch.float32, 9)
    packed, up_val = _forward(ffn)
    dense = R.backward_dense_rows_ref(dout, *ffn.args(), packed)
    assert set(torch.nonzero(dense).flatten().tolist()) == set(hot)
    for gemm in (False, True):  # also H over several neuron blocks of the GEMM kernel (32 wide)
        got = _grads(ffn, dout, packed, up_val, 0.5, scratch=32, gemm=gemm)
        assert_grads_close(got, _reference(ffn, dout, packed, up_val, 0.5), torch.float32, label=f"gemm={gemm} ")


@pytest.mark.parametrize("density", [0.0, 1.0])
@pytest.mark.parametrize("gated", [True, False])
def test_density_extremes(density, gated):
    """No active pair at all (weights' grads exactly zero), and every row overflowing (all dense)."""
    ffn = _on(make_ffn(9, 12, 130, density=density, gated=gated, bias=True, seed=2), DEV)
    dout = _dout(9, 12, torch.float32, 2)
    packed, up_val = _forward(ffn)
    got = _grads(ffn, dout, packed, up_val, 0.5)
    assert_grads_close(got, _reference(ffn, dout, packed, up_val, 0.5), torch.float32)
    assert_grads_close(_grads(ffn, dout, packed, up_val, 0.5, gemm=True), got, torch.float32, label="gemm ")
    if density == 0.0:
        for name in ("dx", "dwg", "dwu", "dwd", "dbg", "dbu"):
            t = getattr(got, name)
            assert t is None or not t.any(), name


# ---------------------------------------------------------------------------------------------
# NaN / Inf
# ---------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**31 - 1), gated=st.booleans(), l1=st.sampled_from([0.0, 0.5]),
       rate=st.sampled_from([0.1, 0.5]))
def test_special_values_in_packed(seed, gated, l1, rate):
    """NaN/±Inf/±0/tiny/huge in the packed pre-activation and in up_val at stored slots propagate
    exactly as in the reference (``sign(NaN) = 0``, ``relu(NaN) = NaN``, ``NaN <= 0`` false);
    garbage in slots that are not stored is never read."""
    ffn = _on(make_ffn(10, 10, 70, density=0.15, gated=gated, bias=True, seed=seed % 1000), DEV)
    dout = _dout(10, 10, torch.float32, seed)
    packed, up_val = _forward(ffn)
    rows = R.backward_dense_rows_ref(dout, *ffn.args(), packed)
    stored = _stored_sparse(packed, rows)
    gen = torch.Generator().manual_seed(seed)
    specials = torch.tensor(SPECIALS, dtype=torch.float32)
    pick = (torch.rand(stored.shape, generator=gen) < rate).to(DEV) & stored
    which = torch.randint(len(SPECIALS), stored.shape, generator=gen).to(DEV)
    val = torch.where(pick, specials.to(DEV)[which], packed.val)
    # Not stored: poison every field (an out-of-range column, NaN values).
    not_stored = ~packed.stored_mask()
    val = torch.where(not_stored, float("nan"), val)
    idx = torch.where(not_stored, torch.full_like(packed.idx, 10**6), packed.idx)
    packed = TwellPacked(idx, val, packed.count)
    if gated:
        pick_u = (torch.rand(stored.shape, generator=gen) < rate / 2).to(DEV) & stored
        up_val = torch.where(pick_u, specials.to(DEV)[which.flip(0)], up_val)
        up_val = torch.where(not_stored, float("nan"), up_val)
    got = _grads(ffn, dout, packed, up_val, l1)
    # A stored 1e30 multiplies dh = dout·Wd_j (+ the L1 term), whose cancellation leaves a few ulps
    # that the summation order sets: the tolerance grows with each element's sum of |terms|.
    assert_grads_close(got, _reference(ffn, dout, packed, up_val, l1), torch.float32,
                       magnitudes=grad_magnitudes(ffn, dout, packed, up_val, l1))


@pytest.mark.parametrize("where", ["x_nan", "x_inf", "dout_inf", "wd_nan", "bu_inf"])
def test_nonfinite_inputs_take_the_dense_rows(where):
    """Non-finite x/dout rows are dense rows; a non-finite weight or bias makes every row dense.
    Results (NaN/Inf patterns included) equal the reference's."""
    ffn = _on(make_ffn(10, 12, 130, density=0.05, gated=True, bias=True, seed=4), DEV)
    dout = _dout(10, 12, torch.float32, 4)
    if where == "x_nan":
        ffn.x[3, 5] = float("nan")
    elif where == "x_inf":
        ffn.x[7, 2] = float("inf")
    elif where == "dout_inf":
        dout[1, 0] = float("-inf")
    elif where == "wd_nan":
        ffn.wd[2, 100] = float("nan")
    else:
        ffn.bu[17] = float("inf")
    packed, up_val = _forward(ffn)
    rows = R.backward_dense_rows_ref(dout, *ffn.args(), packed)
    assert rows.any()
    ref = _reference(ffn, dout, packed, up_val, 0.5)
    for gemm in (False, True):
        got = _grads(ffn, dout, packed, up_val, 0.5, dense_rows=rows, gemm=gemm)
        assert_grads_close(got, ref, torch.float32, label=f"gemm={gemm} ")


# ---------------------------------------------------------------------------------------------
# Small pieces: helper, degenerate shapes, argument checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gated", [True, False])
def test_backward_dense_rows_helper(gated):
    ffn = _on(make_ffn(16, 8, 130, density=0.05, gated=gated, bias=True, hot_rows=(2, 9), seed=8), DEV)
    dout = _dout(16, 8, torch.float32, 8)
    dout[4, 1] = float("nan")
    ffn.x[6, 3] = float("inf")
    packed, _ = _forward(ffn)
    expect = R.backward_dense_rows_ref(dout, *ffn.args(), packed)
    assert torch.equal(backward_dense_rows(dout, *ffn.args(), packed), expect)
    fwd = R.dense_rows_ref(*ffn.args(), packed)
    assert torch.equal(backward_dense_rows(dout, *ffn.args(), packed, forward_rows=fwd), expect)
    guard = fwd & ~packed.overflow_rows()  # what sparse_ffn.guard_rows returns
    assert torch.equal(backward_dense_rows(dout, *ffn.args(), packed, forward_rows=guard), expect)


@pytest.mark.parametrize("m,d,h", [(0, 8, 20), (3, 1, 1), (1, 1, 129), (2, 40, 130)])
def test_degenerate_shapes(m, d, h):
    ffn = _on(make_ffn(m, d, h, density=0.5, gated=True, bias=True, seed=1), DEV)
    dout = _dout(m, d, torch.float32, 1)
    packed, up_val = _forward(ffn)
    assert_grads_close(_grads(ffn, dout, packed, up_val, 0.5), _reference(ffn, dout, packed, up_val, 0.5), torch.float32)


def test_argument_errors_name_the_argument():
    ffn = _on(make_ffn(4, 8, 20, density=0.5, gated=True, bias=True), DEV)
    dout = _dout(4, 8, torch.float32, 0)
    packed, up_val = _forward(ffn)
    rows = R.backward_dense_rows_ref(dout, *ffn.args(), packed)
    l1 = torch.tensor(0.1, device=DEV)
    args = dict(dout=dout, x=ffn.x, wg=ffn.wg, wu=ffn.wu, wd=ffn.wd, bg=ffn.bg, bu=ffn.bu, bd=ffn.bd,
                packed=packed, up_val=up_val, dense_rows=rows, l1_scale=l1)
    bad = {
        "dout": dout[:, :5],
        "wd": ffn.wd.T.contiguous(),
        "wu": ffn.wu.half(),
        "up_val": up_val[:2],
        "dense_rows": rows.int(),
        "l1_scale": 0.1,
        "bg": ffn.bg[:3],
        "packed": tuple(packed),
    }
    for name, value in bad.items():
        with pytest.raises((ValueError, TypeError), match=name):
            sparse_ffn_backward(**{**args, name: value})
    with pytest.raises(ValueError, match="bg"):
        sparse_ffn_backward(**{**args, "wg": None})


# ---------------------------------------------------------------------------------------------
# GPU (run on the H200 with -m gpu)
# ---------------------------------------------------------------------------------------------


def _gpu_ffn(m: int, d: int, h: int, density: float, *, gated=True, bias=True, dtype=torch.bfloat16, seed=0) -> FFN:
    """make_ffn's construction (constant feature, unit-norm gate rows, bias at the normal quantile
    of the density), built in float64 directly on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    f64 = torch.float64

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=f64, device="cuda")

    x = randn(m, d)
    x[:, 0] = 1.0
    w = randn(h, d)
    w[:, 1:] /= torch.linalg.vector_norm(w[:, 1:], dim=1, keepdim=True)
    thresh = gate_threshold(torch.full((h,), density, dtype=f64, device="cuda"))
    if bias:
        w[:, 0] = 0.0
        b = thresh
    else:
        w[:, 0] = thresh
        b = None
    wd = randn(d, h) / math.sqrt(h)
    bd = 0.1 * randn(d) if bias else None
    if gated:
        ffn = FFN(x, w, randn(h, d) / math.sqrt(d), wd, b, 0.1 * randn(h) if bias else None, bd)
    else:
        ffn = FFN(x, None, w, wd, None, b, bd)
    return ffn.to(dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_matches_reference(dtype, gated):
    ffn = _gpu_ffn(1000, 320, 1000, 0.03, gated=gated, dtype=dtype, seed=1)
    dout = torch.randn(1000, 320, device="cuda", dtype=torch.float64).to(dtype)
    packed, up_val = _forward(ffn)
    ref = _reference(ffn, dout, packed, up_val, 100.0)
    got = _grads(ffn, dout, packed, up_val, 100.0)
    assert_grads_close(got, ref, dtype)
    # 20 extra rows forced dense (finite data: the dense formulas give the same values), across
    # the scratch boundary.
    rows = R.backward_dense_rows_ref(dout, *ffn.args(), packed)
    rows[torch.arange(3, 1000, 50, device="cuda")] = True
    for scratch, gemm in ((None, False), (None, True), (16, False), (16, True), (0, False)):
        got = _grads(ffn, dout, packed, up_val, 100.0, dense_rows=rows, scratch=scratch, gemm=gemm)
        assert_grads_close(got, ref, dtype, label=f"scratch={scratch} gemm={gemm} ")


@gpu
@needs_cuda
@pytest.mark.parametrize("density", [0.005, 0.02])
@pytest.mark.parametrize("l1_per_token", [0.0, 0.3])
def test_gpu_accuracy_vs_float64_at_benchmark_shape(density, l1_per_token):
    """M=4096, D=2048, H=5632, bf16: each gradient's ‖g − g₆₄‖/‖g₆₄‖ is no worse than dense bf16
    autograd's (×1.05, docs/architecture.md, 'Exactness contract')."""
    m, d, h = 4096, 2048, 5632
    ffn = _gpu_ffn(m, d, h, density, seed=2)
    dout = (torch.randn(m, d, device="cuda", dtype=torch.float64) * 0.1).to(torch.bfloat16)
    l1 = l1_per_token * m
    packed, up_val = _forward(ffn)
    rows = backward_dense_rows(dout, *ffn.args(), packed)
    _, ref64 = dense_grads(ffn.double(), dout.double(), l1)
    _, dense16 = dense_grads(ffn, dout, l1)
    heavy = rows.clone()
    heavy[::32] = True  # 128 rows dense: their weight gradients as GEMMs or gathered per neuron
    for label, dense_rows, gemm in (("", rows, False), ("128 dense rows, gemm ", heavy, True),
                                    ("128 dense rows ", heavy, False)):
        got = sparse_ffn_backward(dout, *ffn.args(), packed, up_val, dense_rows, torch.tensor(l1, device="cuda"),
                                    dense_wgrad_gemm=gemm)
        for name, g in zip(GRAD_NAMES, got):
            ours = rel_error(g, ref64[name])
            theirs = rel_error(dense16[name], ref64[name], nan_mismatch="inf")
            assert ours <= 1.05 * theirs + 1e-6, f"{label}{name}: sparse {ours:.3e} vs dense bf16 {theirs:.3e}"


@gpu
@needs_cuda
def test_gpu_hot_neurons_split_over_programs():
    """M=4096, D=2048, H=5632, bf16, 0.5% density, with 9 neurons active on half the tokens (~2048
    pairs each, past ``HOT_SPLIT_MIN``): the weight-gradient kernel splits their pairs over
    ``HOT_SEGMENTS`` programs. Each gradient is as accurate as dense bf16 autograd against
    float64, and bitwise the same run to run (the segments are summed in a fixed order)."""
    m, d, h = 4096, 2048, 5632
    ffn = _gpu_ffn(m, d, h, 0.005, seed=4)
    hot = torch.arange(0, h, 700, device="cuda")
    ffn.bg[hot] = 0.0  # gate = N(0, 1) over tokens: active on half of them
    dout = (torch.randn(m, d, device="cuda", dtype=torch.float64) * 0.1).to(torch.bfloat16)
    l1 = 0.3 * m
    packed, up_val = _forward(ffn)
    assert int((packed.idx[packed.stored_mask()] == 700).sum()) >= HOT_SPLIT_MIN
    rows = backward_dense_rows(dout, *ffn.args(), packed)
    rows[::512] = True  # 8 dense rows: segment 0 of each split neuron adds them
    _, ref64 = dense_grads(ffn.double(), dout.double(), l1)
    _, dense16 = dense_grads(ffn, dout, l1)
    for gemm in (False, True):
        args = (dout, *ffn.args(), packed, up_val, rows, torch.tensor(l1, device="cuda"))
        got = sparse_ffn_backward(*args, dense_wgrad_gemm=gemm)
        again = sparse_ffn_backward(*args, dense_wgrad_gemm=gemm)
        for name, g, g2 in zip(GRAD_NAMES, got, again):
            if g is None:
                continue
            assert torch.equal(g, g2), f"gemm={gemm} {name} differs run to run"
            ours = rel_error(g, ref64[name])
            theirs = rel_error(dense16[name], ref64[name], nan_mismatch="inf")
            assert ours <= 1.05 * theirs + 1e-6, f"gemm={gemm} {name}: sparse {ours:.3e} vs dense bf16 {theirs:.3e}"


@gpu
@needs_cuda
@pytest.mark.parametrize("gemm", [False, True])
def test_gpu_no_host_sync_cuda_graph_and_determinism(gemm):
    m, d, h = 2048, 512, 1500
    ffn = _gpu_ffn(m, d, h, 0.02, seed=3)
    dout = torch.randn(m, d, device="cuda").to(torch.bfloat16)
    packed, up_val = _forward(ffn)
    rows = backward_dense_rows(dout, *ffn.args(), packed)
    rows[[3, 100, 1999]] = True  # a few dense rows
    l1 = torch.tensor(0.3 * m, device="cuda")
    args = (dout, *ffn.args(), packed, up_val, rows, l1)
    first = sparse_ffn_backward(*args, dense_wgrad_gemm=gemm)  # warm-up: compiles and autotunes (synchronises)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = sparse_ffn_backward(*args, dense_wgrad_gemm=gemm)
        backward_dense_rows(dout, *ffn.args(), packed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, a, b in zip(GRAD_NAMES, first, again):
        if a is not None:
            assert torch.equal(a, b), f"{name} differs run to run"

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            captured = sparse_ffn_backward(*args, dense_wgrad_gemm=gemm)
    torch.cuda.current_stream().wait_stream(stream)
    new_dout = torch.randn_like(dout)
    dout.copy_(new_dout)
    l1.fill_(0.1 * m)
    graph.replay()
    torch.cuda.synchronize()
    eager = sparse_ffn_backward(*args, dense_wgrad_gemm=gemm)
    for name, a, b in zip(GRAD_NAMES, captured, eager):
        if a is not None:
            assert torch.equal(a, b), f"{name}: graph replay differs from eager"
