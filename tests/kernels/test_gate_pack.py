"""The gate GEMM with the TwELL epilogue (kernels/gate_pack.py) against ``reference.gate_pack_ref``.

Oracle: ``gate_pack_ref`` on the same inputs. ``count`` must match everywhere and ``idx``/``val``
on every stored slot. Exactness comes from the inputs: small integers (and a one-hot ``x`` that
copies a designed pre-activation matrix into the output), so every product and sum is exact in
fp32 whatever the summation order, and activity (``not (pre <= 0)``) cannot flip at zero.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (tests/conftest.py) on tiny shapes, through
both the pointer and the TMA-descriptor load paths. ``-m gpu`` runs the benchmark shape on the
H200, exact with integer data, and within fp32 roundoff of a float64 pre-activation otherwise.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.strategies import EDGE_H, sizes  # noqa: E402
from twell_compile.kernels import reference as R  # noqa: E402
from twell_compile.kernels.format import TwellLayout, is_paired  # noqa: E402
from twell_compile.kernels.gate_pack import KERNELS, gate_pack  # noqa: E402
from twell_compile.kernels.gate_pack_configs import set_tma_blocks  # noqa: E402
from twell_compile.kernels.triton_helpers import INTERPRET  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
INF, NAN = float("inf"), float("nan")


def assert_packed_equal(got, ref, *, label: str = "") -> None:
    """count everywhere; idx and val on the reference's stored slots (NaN equal to NaN)."""
    assert torch.equal(got.count.cpu(), ref.count.cpu()), f"{label} count differs"
    stored = ref.stored_mask().cpu()
    assert torch.equal(got.idx.cpu()[stored], ref.idx.cpu()[stored]), f"{label} idx differs on stored slots"
    g, r = got.val.cpu()[stored], ref.val.cpu()[stored]
    assert torch.equal(g.isnan(), r.isnan()), f"{label} NaN pattern of val differs"
    keep = ~r.isnan()
    assert torch.equal(g[keep], r[keep]), f"{label} val differs on stored slots"


def copy_matrix(pre: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, w)`` with ``x @ w.T == pre`` exactly: ``x = [I, 0]``, ``w = [preᵀ, 0]`` (D padded to
    16 columns so that TMA's 16-byte rows hold)."""
    m, h = pre.shape
    d = -(-m // 16) * 16
    w = torch.zeros(h, d)
    w[:, :m] = pre.T
    return torch.eye(m, d, dtype=dtype, device=DEV), w.to(dtype).to(DEV)


def int_inputs(m, d, h, dtype, seed, *, bias: bool, density_shift: int = 0, skew: int = 0):
    """Small-integer x, w (and bias) for which fp32 GEMMs are exact in any summation order.
    ``skew``: per-neuron bias offsets in [-skew, skew], so some neurons are (nearly) always on and
    others off."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (m, d), generator=gen).to(dtype)
    w = torch.randint(-2, 3, (h, d), generator=gen).to(dtype)
    b = None
    if bias:
        b = (torch.randint(-3, 4, (h,), generator=gen) + density_shift).float()
        if skew:
            b += torch.randint(-skew, skew + 1, (h,), generator=gen).float()
    return x.to(DEV), w.to(DEV), None if b is None else b.to(DEV)


@contextlib.contextmanager
def epilogue(kind: str):
    """``gate_pack`` with one config whose epilogue ranks the actives by bit counts ("bits") or by
    a cumsum over row halves ("scan"); the autotuner's configs are restored after."""
    kernel = KERNELS["gate_pack"]
    saved = kernel.configs, kernel.cache
    bm, bk, warps, stages = (32, 32, 4, 1) if INTERPRET else (128, 32, 8, 3)  # fp32 tiles fit shared memory
    meta = {"BLOCK_M": bm, "BLOCK_K": bk, "PERSISTENT": True, "BIT_RANKS": kind == "bits",
            "EPI_SPLIT": 1 if kind == "bits" else 2}
    config = triton.Config(meta, num_warps=warps, num_stages=stages, pre_hook=set_tma_blocks)
    kernel.configs, kernel.cache = [config], {}
    try:
        yield
    finally:
        kernel.configs, kernel.cache = saved


EPILOGUES = ["bits", "scan"]


# ---------------------------------------------------------------------------------------------
# Designed patterns: capacity edges, all-zero and all-active rows, partial last tile
# ---------------------------------------------------------------------------------------------


def designed_pre(h: int = 300, m: int = 9) -> torch.Tensor:
    """Rows: all zero (0 is inactive); all active; 16 | 17 | 16 actives per tile (last tile
    partial); one active at each tile edge; negatives with -0.0; random ±; a skewed hot neuron
    block; all active but the last column; alternating."""
    pre = -torch.ones(m, h)
    pre[0] = 0.0
    pre[1] = torch.arange(1, h + 1, dtype=torch.float32)
    for tile, n in enumerate((16, 17, 16)):
        lo = tile * 128
        hi = min(h, lo + 128)
        pick = torch.randperm(hi - lo, generator=torch.Generator().manual_seed(tile))[:n]
        pre[2, lo + pick] = 3.0
    pre[3, [0, 127, 128, 255, 256, h - 1]] = 2.0
    pre[4] = -0.0
    gen = torch.Generator().manual_seed(1)
    pre[5] = torch.randint(-4, 5, (h,), generator=gen).float()
    pre[6, :24] = 5.0
    pre[7] = 1.0
    pre[7, -1] = -1.0
    pre[8, ::2] = 7.0
    return pre


@pytest.mark.parametrize("kind", EPILOGUES)
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_designed_patterns(dtype, use_tma, kind):
    pre = designed_pre()
    x, w = copy_matrix(pre, dtype)
    with epilogue(kind):
        got = gate_pack(x, w, use_tma=use_tma)
    ref = R.gate_pack_ref(x, w)
    assert_packed_equal(got, ref)
    assert got.count[2].tolist() == [16, 17, 16]
    assert got.count[1].tolist() == [128, 128, 300 - 256]
    assert got.count[0].sum() == 0 and got.count[4].sum() == 0


def test_bias_shifts_activity_and_is_stored_in_val():
    pre = designed_pre()
    x, w = copy_matrix(pre, torch.float32)
    b = torch.linspace(-2.0, 2.0, pre.shape[1], device=DEV)
    assert_packed_equal(gate_pack(x, w, b), R.gate_pack_ref(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nan_and_inf_in_the_bias(dtype):
    """NaN and +Inf are active, -Inf is not: a NaN gate must reach the consumer (relu(NaN) = NaN)."""
    gen = torch.Generator().manual_seed(3)
    x, w, _ = int_inputs(20, 12, 260, dtype, 3, bias=False)
    b = torch.randint(-3, 4, (260,), generator=gen).float()
    b[[0, 5, 130, 259]] = NAN
    b[[1, 6, 131]] = INF
    b[[2, 7, 132]] = -INF
    b = b.to(DEV)
    got = gate_pack(x, w, b)
    assert_packed_equal(got, R.gate_pack_ref(x, w, b))
    stored = R.unpack_ref(got, 260)
    assert stored[:, 0].isnan().all() and (stored[:, 1] == INF).all() and (stored[:, 2] == 0).all()


@pytest.mark.parametrize("kind", EPILOGUES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nonfinite_x_rows(dtype, kind):
    """Inf in x gives ±Inf and NaN (Inf·0, Inf−Inf) pre-activations, with the same pattern."""
    x, w, b = int_inputs(17, 10, 140, dtype, 4, bias=True)
    x[3, 2] = INF
    x[5, 0] = -INF
    x[5, 1] = INF
    x[8, 4] = NAN
    with epilogue(kind):
        got = gate_pack(x, w, b)
    assert_packed_equal(got, R.gate_pack_ref(x, w, b))


def test_float16_overflow_is_stored_as_accumulated_and_read_as_inf():
    """Pre-activations past float16's range are stored as accumulated (finite), and the sparse
    kernel reads them as +Inf, as dense float16 PyTorch rounds the gate: a gate of 70000 times an up
    of 2^-10 gives h = Inf, not 68.4."""
    from twell_compile.kernels.sparse_ffn import sparse_ffn

    pre = torch.tensor([[70000.0, -70000.0, 65504.0, 65519.0, 65520.0, 1.0, -1.0, 3.0]])
    x = torch.tensor([[256.0]], dtype=torch.float16, device=DEV)
    w = (pre.T / 256.0).to(torch.float16).to(DEV)  # 256 · w is exact, the product exceeds 65504
    got = gate_pack(x, w)
    assert_packed_equal(got, R.gate_pack_ref(x, w))
    vals = got.val[0, 0, : int(got.count[0, 0])].tolist()
    products = (256.0 * w.float().cpu()).view(-1)  # exact in fp32
    assert vals == products[products > 0].tolist() and vals[0] == 70016.0 and max(vals[1:4]) >= 65520.0

    wg = w.clone()
    wg[2:6] = -1.0  # active: 70016 and 3
    wu = torch.full((8, 1), 2.0**-18, dtype=torch.float16, device=DEV)  # up = 2^-10
    wd = torch.ones(1, 8, dtype=torch.float16, device=DEV)
    packed = gate_pack(x, wg)
    assert packed.val[0, 0, 0].item() == 70016.0
    out = sparse_ffn(x, packed, wu, wd, wg=wg)
    assert out.item() == INF
    assert torch.equal(out, R.ffn_forward_ref(x, wg, wu, wd).out)


@settings(max_examples=25, deadline=None)
@given(
    m=sizes(1, 40, (1, 2, 31, 32, 33)),
    d=sizes(1, 48, (1, 16, 31, 32, 33)),
    h=sizes(1, 300, EDGE_H),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    bias=st.booleans(),
    shift=st.integers(-8, 8),
    skew=st.sampled_from([0, 0, 40]),
    use_tma=st.booleans(),
    kind=st.sampled_from(EPILOGUES),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference_on_integer_inputs(m, d, h, dtype, bias, shift, skew, use_tma, kind, seed):
    """Any shape (tails of M, K and the last tile), densities from 0 to 100% through the bias,
    skewed neurons."""
    x, w, b = int_inputs(m, d, h, dtype, seed, bias=bias, density_shift=shift, skew=skew)
    if use_tma and (d * x.element_size()) % 16:
        use_tma = False  # TMA needs 16-byte rows
    with epilogue(kind):
        got = gate_pack(x, w, b, use_tma=use_tma)
    assert_packed_equal(got, R.gate_pack_ref(x, w, b), label=f"m={m} d={d} h={h} {kind}")


@settings(max_examples=10, deadline=None)
@given(
    m=sizes(1, 24, (1, 17)),
    h=sizes(1, 200, (1, 15, 16, 17, 127, 129)),
    tile_n=st.sampled_from([16, 32, 64, 256]),
    slots=st.integers(1, 16),
    seed=st.integers(0, 2**31 - 1),
)
def test_other_layouts(m, h, tile_n, slots, seed):
    layout = TwellLayout(tile_n=tile_n, slots=min(slots, tile_n))
    x, w, b = int_inputs(m, 9, h, torch.float32, seed, bias=True)
    got = gate_pack(x, w, b, layout=layout)
    assert got.idx.shape == (m, layout.n_tiles(h), layout.slots)
    assert_packed_equal(got, R.gate_pack_ref(x, w, b, layout))


@pytest.mark.parametrize("kind", EPILOGUES)
def test_paired_and_separate_buffers_hold_the_same_entries(kind):
    """``paired`` changes where the slots live, not what they hold."""
    x, w, b = int_inputs(37, 24, 300, torch.float16, 5, bias=True)
    with epilogue(kind):
        paired, separate = gate_pack(x, w, b), gate_pack(x, w, b, paired=False)
    assert is_paired(paired) and not is_paired(separate)
    assert separate.idx.is_contiguous() and separate.val.is_contiguous()
    assert_packed_equal(paired, separate, label=kind)
    assert_packed_equal(paired, R.gate_pack_ref(x, w, b), label=kind)


def test_strided_inputs():
    """Non-contiguous x and w (views) go through the pointer path with their strides."""
    x, w, b = int_inputs(21, 30, 150, torch.float32, 5, bias=True)
    xt = x.T.contiguous().T  # column-major view
    wt = w.T.contiguous().T
    assert not xt.is_contiguous() and not wt.is_contiguous()
    assert_packed_equal(gate_pack(xt, wt, b), R.gate_pack_ref(x, w, b))


def test_random_float_values_are_close_to_float64():
    """Random floats: stored values within fp32 roundoff of the float64 pre-activation."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(33, 40, generator=gen)
    w = torch.randn(200, 40, generator=gen) / 6
    b = torch.randn(200, generator=gen) - 1.0
    got = gate_pack(x.to(DEV), w.to(DEV), b.to(DEV))
    pre64 = x.double() @ w.double().T + b.double()
    stored = got.stored_mask().cpu()
    m_i = torch.arange(33).view(-1, 1, 1).expand_as(stored)[stored]
    exact = pre64[m_i, got.idx.cpu()[stored].long()]
    torch.testing.assert_close(got.val.cpu()[stored].double(), exact, rtol=1e-5, atol=1e-5)
    assert (exact > 0).all()


def test_empty_shapes():
    x = torch.zeros(0, 8, device=DEV)
    w = torch.zeros(20, 8, device=DEV)
    p = gate_pack(x, w)
    assert p.idx.shape == (0, 1, 16) and p.count.shape == (0, 1)
    p = gate_pack(torch.ones(3, 0, device=DEV), torch.ones(5, 0, device=DEV), torch.tensor([1.0, -1, 0, 2, -3], device=DEV))
    assert p.count.tolist() == [[2]] * 3  # D = 0: pre = bias


def test_argument_errors_name_the_argument():
    x = torch.zeros(4, 8, device=DEV)
    w = torch.zeros(20, 8, device=DEV)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        gate_pack(x[0], w)
    with pytest.raises(ValueError, match="w must have shape"):
        gate_pack(x, torch.zeros(20, 7, device=DEV))
    with pytest.raises(TypeError, match="w must have dtype"):
        gate_pack(x, w.half())
    with pytest.raises(TypeError, match="x must have dtype"):
        gate_pack(x.double(), w.double())
    with pytest.raises(ValueError, match="b must have shape"):
        gate_pack(x, w, torch.zeros(19, device=DEV))
    with pytest.raises(ValueError, match="tile_n"):
        gate_pack(x, w, layout=TwellLayout(tile_n=8, slots=4))
    with pytest.raises(ValueError, match="use_tma"):
        gate_pack(torch.zeros(4, 5, device=DEV), torch.zeros(20, 5, device=DEV), use_tma=True)


# ---------------------------------------------------------------------------------------------
# GPU (H200): the benchmark shape
# ---------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("kind", ["autotuned"] + EPILOGUES)
@pytest.mark.parametrize("dtype,use_tma", [
    pytest.param(dtype, tma, id=f"{str(dtype).removeprefix('torch.')}-tma{tma}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32) for tma in (None, False, True)
    if not (dtype == torch.float32 and tma)  # fp32 keeps the pointer path: use_tma=True is not a case
])
def test_gpu_benchmark_shape_exact_on_integers(dtype, use_tma, kind):
    """M=4096, D=2048, H=5632 with integer data: exact whatever the tensor-core summation order,
    with the autotuner's pick and with each epilogue."""
    x, w, b = int_inputs(4096, 2048, 5632, dtype, 0, bias=True, density_shift=-185)  # ~2% active
    with epilogue(kind) if kind != "autotuned" else contextlib.nullcontext():
        got = gate_pack(x, w, b, use_tma=use_tma)
    ref = R.gate_pack_ref(x, w, b)
    assert 0.001 < ref.count.float().mean() / 128 < 0.5
    assert_packed_equal(got, ref)


@gpu
@pytest.mark.parametrize("density", [0.005, 0.02, 0.2])
def test_gpu_benchmark_shape_random(density):
    """bf16 random data: every stored value within fp32 roundoff of the float64 pre-activation,
    and counts equal in every tile with no pre-activation within that roundoff of zero."""
    gen = torch.Generator().manual_seed(1)
    m, d, h = 4096, 2048, 5632
    x = torch.randn(m, d, generator=gen).bfloat16().cuda()
    w = (torch.randn(h, d, generator=gen) / d**0.5).bfloat16().cuda()
    b = torch.full((h,), float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(density))), device="cuda")
    got = gate_pack(x, w, b)
    pre64 = x.double() @ w.double().T + b.double()
    scale = x.double().abs() @ w.double().abs().T  # bounds the fp32 summation error
    stored = got.stored_mask()
    m_i = torch.arange(m, device="cuda").view(-1, 1, 1).expand_as(stored)[stored]
    j = got.idx[stored].long()
    err = (got.val[stored].double() - pre64[m_i, j]).abs()
    assert (err <= 2e-5 * scale[m_i, j]).all(), f"max error {err.max().item()}"
    ref = R.pack_ref(pre64.float())
    clear = (pre64.abs() > 1e-6 * scale).view(m, -1, 128).all(-1)  # h = 44 · 128
    assert clear.float().mean() > 0.9
    assert torch.equal(got.count[clear], ref.count[clear])
