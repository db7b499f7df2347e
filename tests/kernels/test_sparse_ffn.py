"""The fused TwELL consumer (kernels/sparse_ffn.py) against ``reference.ffn_forward_ref``.

Oracles:

* ``ffn_forward_ref(...).out`` and ``.up_val`` on the same inputs and the same packed buffer, up to
  fp32 summation order (fp32) or one rounding flip of the output (fp16); NaN/Inf patterns exactly;
* the same call with other routings (``dense_rows=None``, the h scratch or the blocked dense
  kernel for whole-dense rows) pinned to the reference's choice of dense rows;
* for packed buffers no FFN produces (NaN/Inf values in sparse rows), a float64 re-derivation of
  the reference's sparse formula;
* fp16 and (GPU) bf16: ``‖out − ref₆₄‖/‖ref₆₄‖`` no worse than the dense PyTorch path's.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py) on tiny shapes
(M ≤ 40, D ≤ 48, H ≤ 300). ``-m gpu`` adds the benchmark shape, CUDA graphs and a no-sync check.
"""

from __future__ import annotations

import importlib
import math
import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.strategies import ffn_configs  # noqa: E402
from tests.utils import FFN, assert_close_verbose, make_ffn, make_ffn_with_pattern, rel_error  # noqa: E402
from twell_compile.kernels import reference as R  # noqa: E402
from twell_compile.kernels.format import DEFAULT_LAYOUT, TwellLayout, TwellPacked, empty_packed, is_paired  # noqa: E402
from twell_compile.kernels.gate_pack import gate_pack  # noqa: E402
from twell_compile.kernels.sparse_ffn import CAPPED_REGS, guard_rows, prune_sparse, sparse_ffn  # noqa: E402

PW = importlib.import_module("twell_compile.kernels.pair_walk")  # the module itself: tests patch its switches

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
INF, NAN = float("inf"), float("nan")

# Parity with the reference. fp32: summation order (the reference computes in float64). 16-bit:
# the fp32 result may round to the neighbouring value (one ulp: 2^-10 for fp16, 2^-7 for bf16).
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}  # × max |expected|


def accuracy_bar(dense_error: float, dtype) -> float:
    """docs/architecture.md, 'Exactness contract', as tests/kernels/test_reference.py applies it:
    the dense path's error (5% slack), plus one unit roundoff, the cost of rounding the exact
    result once."""
    return 1.05 * dense_error + torch.finfo(dtype).eps / 2


def _on(ffn: FFN, device=DEV) -> FFN:
    return FFN(*(None if t is None else t.to(device) for t in ffn.args()))


def _run(ffn: FFN, packed, dense_rows, layout=DEFAULT_LAYOUT, **kw):
    x, wg, wu, wd, bg, bu, bd = ffn.args()
    return sparse_ffn(x, packed, wu, wd, bu, bd, dense_rows=dense_rows, wg=wg, bg=bg, layout=layout, **kw)


def assert_out_close(got, ref, dtype, label=""):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    finite = ref[torch.isfinite(ref)].double().abs()
    scale = finite.max().item() if finite.numel() else 1.0
    assert_close_verbose(got, ref, rtol=RTOL[dtype], atol=ATOL[dtype] * max(scale, 1e-30), name=label)


def defined_up(up, packed, dense_rows):
    """``up`` with 0 in every slot ``sparse_ffn`` leaves unspecified: all but the stored pairs of
    rows that are neither dense nor overflowed (no host sync: usable under capture). Plain FFNs
    have none: their empty ``up`` is returned as it is."""
    if up.numel() == 0:
        return up
    whole = packed.overflow_rows() if dense_rows is None else dense_rows | packed.overflow_rows()
    return torch.where(packed.stored_mask() & ~whole.view(-1, 1, 1), up, 0.0)


def expected_l1_rows(res: R.ForwardResult, ffn: FFN) -> torch.Tensor:
    """float64 ``[M]``: each row's ``Σ |h|`` over its stored pairs, as the reference computes h
    (gated: with the input dtype's overflow points), and 0 for the reference's dense rows."""
    stored = res.packed.stored_mask() & ~res.dense_rows.view(-1, 1, 1)
    act = torch.relu(R.overflow_like(res.packed.val.double(), ffn.dtype))  # stored as accumulated
    h = R.overflow_like(act * res.up_val.double(), ffn.dtype) if ffn.gated else act
    return torch.where(stored, h.abs(), 0.0).sum((1, 2))


def check_against_reference(ffn: FFN, layout=DEFAULT_LAYOUT, *, routes=((None, None),), label=""):
    """``sparse_ffn`` with the reference's dense rows (and its up values and L1 shares), then with
    each routing in ``routes`` (``(dense_rows or None, dense_scratch_rows)``): same ``out`` every
    time."""
    res = R.ffn_forward_ref(*ffn.args(), layout=layout)
    l1_rows = torch.full((ffn.x.shape[0],), NAN, device=ffn.x.device)  # every row must be written
    out, up = _run(ffn, res.packed, res.dense_rows, layout, return_up=True, l1_rows=l1_rows)
    assert_out_close(out, res.out, ffn.dtype, label=f"{label} out")
    want_l1 = expected_l1_rows(res, ffn)
    finite = want_l1[torch.isfinite(want_l1)]
    scale = finite.max().item() if finite.numel() else 1.0
    assert_close_verbose(l1_rows, want_l1, rtol=1e-5, atol=1e-6 * max(scale, 1e-30), name=f"{label} l1_rows")
    stored = res.packed.stored_mask() & ~res.dense_rows.view(-1, 1, 1)  # up_val is unspecified elsewhere
    if ffn.gated:
        assert_close_verbose(up[stored], res.up_val[stored], rtol=1e-5,
                             atol=1e-5 * max(1.0, res.up_val.abs().max().item()), name=f"{label} up_val")
    else:
        assert up.shape == (0,)
    for dense_rows, scratch_rows in routes:
        got, up2 = _run(ffn, res.packed, dense_rows, layout, dense_scratch_rows=scratch_rows, return_up=True)
        route = f"dense_rows={dense_rows is not None}, scratch_rows={scratch_rows}"
        assert_out_close(got, res.out, ffn.dtype, label=f"{label} out ({route})")
        if ffn.gated:  # rows flagged beyond the reference's have no up values
            keep = torch.ones_like(res.dense_rows) if dense_rows is None else ~(dense_rows & ~res.dense_rows)
            both = stored & keep.view(-1, 1, 1)
            assert torch.equal(up2[both].isnan(), up[both].isnan())
            assert torch.allclose(up2[both], up[both], equal_nan=True)
    return res


# ---------------------------------------------------------------------------------------------
# Property test: random shapes, densities, biases, gated/plain, skew, hot rows, layouts
# ---------------------------------------------------------------------------------------------


@settings(max_examples=14, deadline=None)
@given(cfg=ffn_configs(dtypes=(torch.float32, torch.float16), max_m=40, max_d=48, max_h=300, min_m=1),
       scratch_rows=st.sampled_from([None, 0, 16]))
def test_matches_reference(cfg, scratch_rows):
    """Whole-dense rows through the h scratch, the blocked kernel (0 scratch rows), or both."""
    ffn = _on(cfg.build())
    check_against_reference(ffn, cfg.layout, routes=((None, scratch_rows),), label=str(cfg))


@pytest.mark.parametrize("gated", [True, False])
def test_tile_by_tile_walk_matches_the_bit_set_walk(gated):
    """Rows of more than 64 tiles walk them one by one (no bit set); forced here on small H, both
    walks give the reference's output and the same up values, bitwise."""
    layout = TwellLayout(tile_n=16, slots=4)  # 64 tiles (all a bit set holds), some overflowed
    ffn = _on(make_ffn(14, 24, 1024, density=0.06, gated=gated, bias=True, skew=1.0, seed=4))
    res = check_against_reference(ffn, layout)
    bits = _run(ffn, res.packed, res.dense_rows, layout, return_up=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PW, "MAX_BIT_TILES", 0)
        walk = _run(ffn, res.packed, res.dense_rows, layout, return_up=True)
    assert torch.equal(bits[0], walk[0])
    assert torch.equal(defined_up(bits[1], res.packed, res.dense_rows), defined_up(walk[1], res.packed, res.dense_rows))


@pytest.mark.parametrize("gated", [True, False])
def test_bf16_rows_read_as_pairs(gated):
    """bf16 rows are read as int32 pairs of elements (``pair_walk.paired``): the reference's
    output, and bitwise the element-wise reads' output and up values. No row is dense here (the
    dense-row kernels' bf16 ``tl.dot`` does not run in the interpreter)."""
    ffn = _on(make_ffn(14, 40, 300, density=0.03, gated=gated, bias=True, skew=1.0, seed=4, dtype=torch.bfloat16))
    assert PW.paired(ffn.x, ffn.wu, ffn.wd.t().contiguous())
    res = R.ffn_forward_ref(*ffn.args())
    assert not res.dense_rows.any()
    pairs = _run(ffn, res.packed, res.dense_rows, return_up=True)
    assert_out_close(pairs[0], res.out, torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PW, "PAIR_READS", False)
        elements = _run(ffn, res.packed, res.dense_rows, return_up=True)
    assert torch.equal(pairs[0], elements[0])
    assert torch.equal(defined_up(pairs[1], res.packed, None), defined_up(elements[1], res.packed, None))


def test_the_register_capped_config_is_tried_only_where_it_does_not_spill():
    """The 4-warp config capped at 56 registers (9 programs an SM on sm90) is tuned only for pair
    reads of rows up to 2048 wide, which ptxas fits in 56 without spilling."""
    plain, capped = (triton.Config({"TOKENS": 1}, num_warps=4, num_stages=1, maxnreg=r) for r in (None, CAPPED_REGS))
    assert prune_sparse([plain, capped], {}, BLOCK_D=2048, PAIRS=True) == [plain, capped]
    assert prune_sparse([plain, capped], {}, BLOCK_D=2048, PAIRS=False) == [plain]
    assert prune_sparse([plain, capped], {}, BLOCK_D=4096, PAIRS=True) == [plain]


# ---------------------------------------------------------------------------------------------
# Designed cases: capacity, overflow routing, density extremes
# ---------------------------------------------------------------------------------------------


def _capacity_pattern(m: int = 12, h: int = 300) -> torch.Tensor:
    """Rows: none active; all active; 16 | 17 | 16 actives per tile (partial last tile);
    17 in every tile; one tile over, two under; a hot block; then 2% random."""
    gen = torch.Generator().manual_seed(0)
    act = torch.zeros(m, h, dtype=torch.bool)
    act[1] = True
    for row, counts in ((2, (16, 17, 16)), (3, (17, 17, 17)), (4, (3, 17, 0)), (5, (16, 16, 16))):
        for tile, n in enumerate(counts):
            lo, hi = tile * 128, min(h, tile * 128 + 128)
            act[row, lo + torch.randperm(hi - lo, generator=gen)[:n]] = True
    act[6, :20] = True
    act[7:] = torch.rand(m - 7, h, generator=gen) < 0.02
    return act


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
def test_capacity_edges_and_every_routing(gated, dtype):
    """16 actives fit a tile, 17 overflow it; a row with an overflowed tile is exact whether it is
    flagged dense by the caller or found by the kernel, through the h scratch or the blocked dense
    kernel."""
    ffn = _on(make_ffn_with_pattern(_capacity_pattern(), gated=gated, dtype=dtype, seed=1))
    res = check_against_reference(ffn, routes=((None, None), (None, 0), (None, 4)))
    assert res.packed.count[2].tolist() == [16, 17, 16]
    assert res.dense_rows[[1, 2, 3, 4, 6]].all() and not res.dense_rows[[0, 5]].any()


@pytest.mark.parametrize("density", [0.0, 1.0])
@pytest.mark.parametrize("gated", [True, False])
def test_density_extremes(density, gated):
    ffn = _on(make_ffn(17, 20, 260, density=density, gated=gated, seed=2))
    check_against_reference(ffn, routes=((None, None), (None, 0), (None, 16)))  # 16 + 1 rows


def as_paired(packed: TwellPacked, hidden: int, layout=DEFAULT_LAYOUT) -> TwellPacked:
    """``packed``'s contents in a paired buffer (``empty_packed(paired=True)``)."""
    out = empty_packed(packed.count.shape[0], hidden, torch.float32, packed.count.device, layout, paired=True)
    for dst, src in zip(out, packed):
        dst.copy_(src)
    return out


@settings(max_examples=8, deadline=None)
@given(cfg=ffn_configs(dtypes=(torch.float32, torch.float16), max_m=40, max_d=48, max_h=300, min_m=1))
def test_paired_slots_property(cfg):
    """Any shape, layout, density, skew and hot rows: paired slots give bitwise the output and up
    values of the same entries in two buffers."""
    ffn = _on(cfg.build())
    res = R.ffn_forward_ref(*ffn.args(), layout=cfg.layout)
    paired = as_paired(res.packed, ffn.wu.shape[0], cfg.layout)
    a = _run(ffn, res.packed, res.dense_rows, cfg.layout, return_up=ffn.gated)
    b = _run(ffn, paired, res.dense_rows, cfg.layout, return_up=ffn.gated)
    if ffn.gated:
        assert_close_verbose(defined_up(a[1], res.packed, res.dense_rows), defined_up(b[1], res.packed, res.dense_rows),
                             rtol=0, atol=0, name=f"{cfg} up")
        a, b = a[0], b[0]
    assert_close_verbose(a, b, rtol=0, atol=0, name=str(cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
def test_paired_slots_read_as_separate_buffers(gated, dtype):
    """A paired TwELL buffer (one 8-byte load a pair) gives bitwise the output and up values of the
    same entries in two buffers: with overflowed tiles, flagged rows, and the guard in the kernel."""
    ffn = _on(make_ffn_with_pattern(_capacity_pattern(), gated=gated, dtype=dtype, seed=2))
    x, wg, wu, wd, bg, bu, bd = ffn.args()
    res = R.ffn_forward_ref(*ffn.args())
    paired = as_paired(res.packed, wu.shape[0])
    assert is_paired(paired) and not is_paired(res.packed)
    for rows in (res.dense_rows, None):
        a = _run(ffn, res.packed, rows, return_up=gated)
        b = _run(ffn, paired, rows, return_up=gated)
        if gated:
            assert_close_verbose(defined_up(a[1], res.packed, rows), defined_up(b[1], res.packed, rows), rtol=0, atol=0)
            a, b = a[0], b[0]
        assert_close_verbose(a, b, rtol=0, atol=0)
    bound = torch.tensor([0.0, 0.0, 1.0], device=DEV)  # the guard never flags: 0·‖x‖ + 0 < 1
    a = sparse_ffn(x, res.packed, wu, wd, bu, bd, wg=wg, bg=bg, guard_bound=bound)
    b = sparse_ffn(x, paired, wu, wd, bu, bd, wg=wg, bg=bg, guard_bound=bound)
    assert_close_verbose(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_end_to_end_with_gate_pack(bias):
    """gate_pack then sparse_ffn, the pair the CUDA op launches, against the reference forward."""
    for gated in (True, False):
        for dtype in (torch.float32, torch.float16):
            ffn = _on(make_ffn(37, 40, 290, density=0.04, gated=gated, bias=bias, dtype=dtype, skew=1.0, seed=3))
            x, wg, wu, wd, bg, bu, bd = ffn.args()
            packed = gate_pack(x, wg, bg) if gated else gate_pack(x, wu, bu)
            got = sparse_ffn(x, packed, wu, wd, bu, bd, dense_rows=guard_rows(*ffn.args()), wg=wg, bg=bg)
            ref = R.ffn_forward_ref(*ffn.args())
            assert_out_close(got, ref.out, dtype, label=f"gated={gated} {dtype}")


def test_hot_rows_and_skewed_neurons():
    ffn = _on(make_ffn(33, 24, 300, density=0.03, skew=3.0, hot_rows=(0, 7, 32), seed=4))
    check_against_reference(ffn, routes=((None, None), (None, 0)))


def test_wd_as_a_transposed_view_and_out_dtype():
    """``wd`` may be the transposed view of a kept ``Wdᵀ`` (no copy); the output dtype is free."""
    ffn = _on(make_ffn(19, 32, 200, density=0.05, seed=5))
    res = R.ffn_forward_ref(*ffn.args())
    wdt = ffn.wd.T.contiguous()
    got = _run(ffn.with_(wd=wdt.T), res.packed, res.dense_rows)
    assert_out_close(got, res.out, torch.float32)
    half = _run(ffn, res.packed, res.dense_rows, out_dtype=torch.float16)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), res.out, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# NaN and Inf
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["x_inf", "x_nan", "bu_inf", "wd_nan", "bg_nan", "wu_inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nonfinite_inputs_match_dense_semantics(where, dtype):
    """Non-finite inputs take the dense rows; NaN and ±Inf land exactly where dense PyTorch
    (the reference) puts them."""
    ffn = _on(make_ffn(13, 24, 140, density=0.05, seed=6, dtype=dtype))
    t = {"x_inf": ffn.x, "x_nan": ffn.x, "bu_inf": ffn.bu, "wd_nan": ffn.wd, "bg_nan": ffn.bg, "wu_inf": ffn.wu}[where]
    value = INF if where.endswith("inf") else NAN
    if t.dim() == 2:
        t[3, 5] = value
    else:
        t[7] = value
    check_against_reference(ffn)


def test_float16_overflow_of_up_and_h():
    """Huge float16 activations: up and h overflow to Inf where dense float16 would (the guard
    flags those rows; the reference mimics dense's rounding points)."""
    ffn = _on(make_ffn(11, 16, 140, density=0.1, seed=7).to(torch.float16))
    ffn.x[2] *= 3000.0
    ffn.x[5] *= 300.0
    check_against_reference(ffn)


def _sparse_oracle(ffn: FFN, packed: TwellPacked) -> torch.Tensor:
    """The reference's sparse-row formula in float64 for any packed buffer, every row sparse."""
    x, wg, wu, wd, bg, bu, bd = (None if t is None else t.double() for t in ffn.args())
    pairs = R.stored_pairs(packed, torch.ones(x.shape[0], dtype=torch.bool, device=x.device))
    pre = pairs.pre.double()
    if wg is not None:
        up = (x[pairs.token] * wu[pairs.neuron]).sum(-1) + (0.0 if bu is None else bu[pairs.neuron])
        h = torch.relu(pre) * up
    else:
        h = torch.relu(pre)
    out = torch.zeros(x.shape[0], wd.shape[0], dtype=torch.float64, device=x.device)
    out.index_add_(0, pairs.token, h[:, None] * wd.T[pairs.neuron])
    return out if bd is None else out + bd


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), gated=st.booleans(), rate=st.sampled_from([0.02, 0.2]))
def test_special_values_in_packed_sparse_rows(seed, gated, rate):
    """NaN and +Inf gate values stored in a sparse row reach the output as relu(·)·up does."""
    ffn = _on(make_ffn(12, 20, 200, density=0.03, gated=gated, seed=seed % 1000))
    gen = torch.Generator().manual_seed(seed)
    pre = torch.where(torch.rand(12, 200, generator=gen) < 0.05, 1.0, -1.0) * torch.rand(12, 200, generator=gen)
    special = torch.tensor([NAN, INF, -INF, 0.0, -0.0])[torch.randint(5, (12, 200), generator=gen)]
    pre = torch.where(torch.rand(12, 200, generator=gen) < rate, special, pre)
    packed = TwellPacked(*(t.to(DEV) for t in R.pack_ref(pre)))
    no_dense = torch.zeros(12, dtype=torch.bool, device=DEV)
    rows = ~packed.overflow_rows()
    got = _run(ffn, packed, no_dense)  # overflowing rows: whole-dense
    expected = _sparse_oracle(ffn, packed)
    scale = max(1.0, expected[rows].nan_to_num(0, 0, 0).abs().max().item())
    assert_close_verbose(got[rows], expected[rows], rtol=1e-5, atol=1e-5 * scale, name="special sparse rows")


# ---------------------------------------------------------------------------------------------
# Accuracy, shapes, errors
# ---------------------------------------------------------------------------------------------


def test_float16_accuracy_no_worse_than_dense():
    """‖out − ref₆₄‖/‖ref₆₄‖ of the float16 sparse path ≤ the dense float16 path's
    (docs/architecture.md, 'Exactness contract')."""
    for gated in (True, False):
        ffn = make_ffn(40, 48, 300, density=0.05, gated=gated, dtype=torch.float16, seed=8)
        ref64 = R.dense_ffn_ref(*ffn.double().args())
        dense16 = R.dense_ffn_ref(*ffn.args())
        dev = _on(ffn)
        got = _run(dev, R.gate_pack_ref(dev.x, dev.wg if gated else dev.wu, dev.bg if gated else dev.bu), None)
        ours, theirs = rel_error(got, ref64), rel_error(dense16, ref64, nan_mismatch="inf")
        assert ours <= accuracy_bar(theirs, torch.float16), f"gated={gated}: sparse {ours:.3e} vs dense fp16 {theirs:.3e}"


@pytest.mark.parametrize("m,d,h", [(1, 1, 1), (3, 1, 129), (2, 40, 128), (5, 17, 257), (0, 8, 20)])
def test_degenerate_shapes(m, d, h):
    ffn = _on(make_ffn(m, d, h, density=0.3, seed=9))
    if m == 0:
        res = R.ffn_forward_ref(*ffn.args())
        out, up = _run(ffn, res.packed, None, return_up=True)
        assert out.shape == (0, d) and up.shape == (0, 1, 16)
        return
    check_against_reference(ffn)


def test_empty_hidden_gives_the_bias():
    x = torch.randn(4, 6, device=DEV)
    w = torch.zeros(0, 6, device=DEV)
    packed = TwellPacked(torch.zeros(4, 0, 16, dtype=torch.int32, device=DEV), torch.zeros(4, 0, 16, device=DEV),
                         torch.zeros(4, 0, dtype=torch.int32, device=DEV))
    bd = torch.arange(6.0, device=DEV)
    l1_rows = torch.full((4,), NAN, device=DEV)
    out = sparse_ffn(x, packed, w, torch.zeros(6, 0, device=DEV), bd=bd, wg=w, l1_rows=l1_rows)
    assert torch.equal(out, bd.expand(4, 6))
    assert torch.equal(l1_rows, torch.zeros(4, device=DEV))  # no neuron: no L1


def test_argument_errors_name_the_argument():
    ffn = _on(make_ffn(4, 8, 20, seed=10))
    x, wg, wu, wd, bg, bu, bd = ffn.args()
    packed = R.gate_pack_ref(x, wg, bg)

    def call(**kw):
        args = dict(x=x, packed=packed, wu=wu, wd=wd, bu=bu, bd=bd, wg=wg, bg=bg)
        args.update(kw)
        return sparse_ffn(**args)

    with pytest.raises(ValueError, match="x must be a 2-D"):
        call(x=x[0])
    with pytest.raises(ValueError, match="wd must have shape"):
        call(wd=wd.T)
    with pytest.raises(TypeError, match="wu must have dtype"):
        call(wu=wu.half())
    with pytest.raises(ValueError, match="wg must have shape"):
        call(wg=wg[:5])
    with pytest.raises(ValueError, match="bd must have shape"):
        call(bd=bu)
    with pytest.raises(ValueError, match="bg was given without wg"):
        call(wg=None)
    with pytest.raises(ValueError, match="packed.idx must have shape"):
        call(packed=R.gate_pack_ref(x, wg, bg, TwellLayout(tile_n=16, slots=4)))
    with pytest.raises(TypeError, match="packed must be a TwellPacked"):
        call(packed=tuple(packed))
    with pytest.raises(TypeError, match="packed.val must have dtype"):
        call(packed=packed._replace(val=packed.val.double()))
    with pytest.raises(TypeError, match="dense_rows must have dtype"):
        call(dense_rows=torch.zeros(4, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="dense_rows must have shape"):
        call(dense_rows=torch.zeros(5, dtype=torch.bool, device=DEV))
    with pytest.raises(TypeError, match="out_dtype"):
        call(out_dtype=torch.int32)
    with pytest.raises(ValueError, match="l1_rows must have shape"):
        call(l1_rows=torch.zeros(5, device=DEV))
    with pytest.raises(TypeError, match="l1_rows must have dtype"):
        call(l1_rows=torch.zeros(4, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="l1_rows must be contiguous"):
        call(l1_rows=torch.zeros(4, 2, device=DEV)[:, 0])


def test_autotune_prune_keeps_the_register_budget():
    """GPU autotuning drops configs whose BLOCK_D weight row needs > 64 registers a thread, and
    always leaves one (large D)."""
    configs = [triton.Config({"TOKENS": t}, num_warps=w) for t, w in ((1, 1), (1, 2), (2, 4), (1, 8))]
    def shapes(block_d):
        return [(c.kwargs["TOKENS"], c.num_warps) for c in prune_sparse(configs, {}, BLOCK_D=block_d)]

    assert shapes(2048) == [(1, 1), (1, 2), (2, 4), (1, 8)]
    assert shapes(8192) == [(2, 4), (1, 8)]
    assert shapes(16384) == [(1, 8)]
    assert shapes(1 << 16) == [(1, 16)]  # none fits: one fallback config


# ---------------------------------------------------------------------------------------------
# GPU (H200): benchmark shape, CUDA graphs, no host sync
# ---------------------------------------------------------------------------------------------


def _gpu_ffn(m, d, h, density, *, gated=True, dtype=torch.bfloat16, skew=0.0, seed=0) -> FFN:
    """``tests.utils.make_ffn``'s recipe built on the GPU: the gate is z + c_j with z ~ N(0, 1) and
    c_j the normal quantile of neuron j's density, through the bias."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)

    x = randn(m, d)
    w_ctrl = randn(h, d) / math.sqrt(d)
    per_neuron = torch.full((h,), density, device="cuda")
    if skew > 0:
        weight = torch.exp(skew * randn(h))
        per_neuron = (density * weight / weight.mean()).clamp(max=1.0)
    c = math.sqrt(2.0) * torch.special.erfinv(2 * per_neuron.clamp(1e-9, 1 - 1e-9) - 1)
    wu = randn(h, d) / math.sqrt(d)
    wd = randn(d, h) / math.sqrt(h)
    bu, bd = 0.1 * randn(h), 0.1 * randn(d)
    if gated:
        ffn = FFN(x, w_ctrl, wu, wd, c, bu, bd)
    else:
        ffn = FFN(x, None, w_ctrl, wd, None, c, bd)
    return ffn.to(dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_matches_reference(dtype, gated):
    ffn = _gpu_ffn(1000, 320, 1000, 0.03, gated=gated, dtype=dtype, seed=1)
    every_row = torch.ones(1000, dtype=torch.bool, device="cuda")  # through the scratch, then the blocked kernel
    check_against_reference(ffn, routes=((None, None), (every_row, None), (every_row, 16)))
    x, wg, wu, wd, bg, bu, bd = ffn.args()
    packed = gate_pack(x, wg, bg) if gated else gate_pack(x, wu, bu)
    out = sparse_ffn(x, packed, wu, wd, bu, bd, wg=wg, bg=bg)
    assert_out_close(out, R.ffn_forward_ref(*ffn.args()).out, dtype, label="gate_pack + sparse_ffn")


@gpu
@pytest.mark.parametrize("skew", [0.0, 3.0])
@pytest.mark.parametrize("density", [0.005, 0.02, 0.2])
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_accuracy_vs_float64_at_benchmark_shape(gated, density, skew):
    """M=4096, D=2048, H=5632, bf16: ‖out − ref₆₄‖/‖ref₆₄‖ no worse than dense bf16 PyTorch's,
    with the reference's dense rows, with the guard rows only (overflow handled in-kernel), and
    with three more rows sent whole-dense."""
    m, d, h = 4096, 2048, 5632
    ffn = _gpu_ffn(m, d, h, density, gated=gated, skew=skew, seed=2)
    x, wg, wu, wd, bg, bu, bd = ffn.args()
    ref64 = R.dense_ffn_ref(*ffn.double().args())
    theirs = rel_error(R.dense_ffn_ref(*ffn.args()), ref64, nan_mismatch="inf")
    packed = gate_pack(x, wg, bg) if gated else gate_pack(x, wu, bu)
    extra = guard_rows(*ffn.args()).index_fill_(0, torch.tensor([0, 17, m - 1], device="cuda"), True)
    for rows in (R.dense_rows_ref(*ffn.args(), packed), None, extra):
        out = sparse_ffn(x, packed, wu, wd, bu, bd, dense_rows=rows, wg=wg, bg=bg)
        ours = rel_error(out, ref64)
        assert ours <= accuracy_bar(theirs, torch.bfloat16), \
            f"sparse {ours:.3e} vs dense bf16 {theirs:.3e} (dense_rows given: {rows is not None})"


@gpu
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_no_host_sync_cuda_graph_and_determinism(gated):
    m, d, h = 2048, 2048, 5632
    ffn = _gpu_ffn(m, d, h, 0.01, gated=gated, seed=3)
    x, wg, wu, wd, bg, bu, bd = ffn.args()

    extra = torch.tensor([3, 100, 1999], device="cuda")  # a few whole-dense rows

    def forward():  # out, and the up values it defines
        packed = gate_pack(x, wg, bg) if gated else gate_pack(x, wu, bu)
        rows = guard_rows(x, wg, wu, wd, bg, bu, bd).index_fill_(0, extra, True)
        out, up = sparse_ffn(x, packed, wu, wd, bu, bd, dense_rows=rows, wg=wg, bg=bg, return_up=True)
        return out, defined_up(up, packed, rows)

    first = forward()  # warm-up: compiles and autotunes (synchronises)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]), "not deterministic"

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            captured = forward()
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    eager = forward()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1]), "graph replay differs from eager"


@pytest.mark.parametrize("gated", [True, False])
def test_the_guard_in_the_pair_loop_flags_marks_and_records_as_flag_rows(gated):
    """``sparse_ffn(guard_bound=...)`` computes the finiteness guard from the x rows it loads and
    gives what ``flag_rows`` before it gives: the same output (NaN where it is NaN), the same
    counts after the marks, and the same call record."""
    from twell_compile.kernels.row_lists import flag_rows
    from twell_compile.kernels.tickets import CallRecord
    from twell_compile.kernels.weights import weight_prep

    g = torch.Generator().manual_seed(3)
    m, d, h = 24, 16, 300
    x = torch.randn(m, d, generator=g).half()
    wg, wu = (torch.randn(h, d, generator=g).half() for _ in range(2))
    wd = torch.randn(d, h, generator=g).half()
    bu = torch.full((h,), -8.0).half()  # sparse up pre-activations (plain)
    bg = torch.full((h,), -8.0).half()  # sparse gates
    wg[:, 15], wu[:, 15] = -wg[:, 15].abs(), -wu[:, 15].abs()  # feature 15 only switches neurons off
    x[2, 3] = float("nan")  # every gate NaN, so active: its tiles overflow
    x[5] = 0.0
    x[5, 15] = float("inf")  # no active neuron, a non-finite row: the guard's alone
    x[7] = 0.0
    x[7, 15] = 3e4  # no active neuron; gated, its fp16 up projection may overflow: the guard's
    x[9, 0] = 2e3  # half the neurons active: its tiles overflow
    x, wg, wu, wd, bu, bg = (t.to(DEV) for t in (x, wg, wu, wd, bu, bg))
    if not gated:
        wg = bg = None
    w, b = (wg, bg) if gated else (wu, bu)
    bound = weight_prep(wg, wu, wd, bg, bu, None)[0]

    def record():
        return CallRecord(torch.zeros(5, dtype=torch.float64, device=DEV), torch.zeros(3, dtype=torch.int64, device=DEV), 1.0)

    before, inside = gate_pack(x, w, b), gate_pack(x, w, b)
    rec_before, rec_inside = record(), record()
    flags, listed = flag_rows(x, bound, count=before.count, slots=DEFAULT_LAYOUT.slots, record=rec_before, mark=True,
                              flag_overflow=True, with_list=True)
    want = sparse_ffn(x, before, wu, wd, bu, None, dense_rows=flags, row_list=listed, wg=wg, bg=bg)
    got = sparse_ffn(x, inside, wu, wd, bu, None, wg=wg, bg=bg, guard_bound=bound, record=rec_inside, mark=True)
    assert bool(flags[[2, 5, 9]].all()) and bool(flags[7]) == gated and not bool(flags[[0, 1, 3]].any())
    assert bool((gate_pack(x, w, b).count[[5, 7]] <= DEFAULT_LAYOUT.slots).all())  # no overflow: the guard's rows
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(inside.count, before.count)  # the same marks
    assert int(inside.count[5, 0]) == DEFAULT_LAYOUT.slots + 1  # a guard row, marked
    assert torch.equal(rec_inside.values, rec_before.values) and int(rec_inside.values[3]) == int(flags.sum())
    assert not rec_inside.scratch.any()  # left zeroed for the next call


def test_guard_bound_argument_errors_name_the_argument():
    ffn = _on(make_ffn(8, 16, 40, gated=True))
    packed = gate_pack(ffn.x, ffn.wg)
    bound = torch.zeros(3, device=DEV)
    with pytest.raises(ValueError, match="record and mark need guard_bound"):
        sparse_ffn(ffn.x, packed, ffn.wu, ffn.wd, wg=ffn.wg, mark=True)
    with pytest.raises(ValueError, match="pass no dense_rows"):
        sparse_ffn(ffn.x, packed, ffn.wu, ffn.wd, dense_rows=torch.zeros(8, dtype=torch.bool, device=DEV), wg=ffn.wg,
                   guard_bound=bound)
    with pytest.raises(ValueError, match="guard_bound"):
        sparse_ffn(ffn.x, packed, ffn.wu, ffn.wd, wg=ffn.wg, guard_bound=torch.zeros(2, device=DEV))
