"""kernels/dense_act.py: the dense path's element-wise passes, forward (``relu(gate) · up`` and
the counters it takes) and backward (L1 term, ``d_gate``, ``d_up``).

Oracles: the eager PyTorch ops they replace (bitwise; under the interpreter bf16 within a rounding
or two, since its fp32 -> bf16 cast truncates where the GPU rounds to nearest even),
``format.is_active`` per TwELL tile for the counts, and ``Σ|h|`` in float64 for the L1 value.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from twell_compile.kernels.dense_act import dense_activation, dense_activation_backward  # noqa: E402
from twell_compile.kernels.tickets import CallRecord  # noqa: E402
from twell_compile.kernels.format import TwellLayout, is_active  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _record(calls=0.0):
    """A call record (``tickets.CallRecord``) with ``calls`` earlier calls and stale fields."""
    return CallRecord(torch.tensor([calls, 3.0, 5.0, 5.0, 1.0], dtype=torch.float64, device=DEV),
                      torch.zeros(3, dtype=torch.int64, device=DEV), 0.0)


def _operands(m, h, dtype, density, seed, specials):
    gen = torch.Generator().manual_seed(seed)
    pre = torch.randn(m, h, generator=gen).abs() * torch.where(torch.rand(m, h, generator=gen) < density, 1.0, -1.0)
    up = torch.randn(m, h, generator=gen)
    if specials and m and h:
        pre[0, 0] = float("nan")  # active: relu(NaN) is NaN
        pre[-1, -1] = 0.0  # inactive
        up[m // 2, h // 2] = float("inf")
        pre[m // 2, h // 2] = 1.0  # inf · active
        if h > 1:
            pre[-1, 0] = float("-inf")
            up[0, 1] = float("nan")  # NaN · (maybe) inactive
    return pre.to(dtype), up.to(dtype)


def _expected_counts(pre, layout):
    m, h = pre.shape
    act = is_active(pre.cpu().double())
    pad = layout.n_tiles(h) * layout.tile_n - h
    per_tile = torch.nn.functional.pad(act, (0, pad)).view(m, layout.n_tiles(h), layout.tile_n).sum(-1)
    return float(act.sum()), float((per_tile > layout.slots).any(-1).sum())


def _assert_h(got, want, dtype, roundings=1):
    bf16_interpreted = dtype == torch.bfloat16 and INTERPRETED
    rtol = roundings * 2**-7 if bf16_interpreted else 0
    torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=rtol * 1e-3, equal_nan=True)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(0, 40), h=st.integers(1, 300), dtype=st.sampled_from(DTYPES), gated=st.booleans(),
       store_act=st.booleans(), density=st.sampled_from([0.0, 0.02, 0.15, 0.5, 1.0]), specials=st.booleans(),
       seed=st.integers(0, 2**16))
@example(m=9, h=256, dtype=torch.bfloat16, gated=True, store_act=True, density=1.0, specials=True, seed=0)
@example(m=1, h=1, dtype=torch.float32, gated=False, store_act=False, density=0.0, specials=False, seed=0)
def test_matches_eager_relu_times_up_and_counts_every_entry(m, h, dtype, gated, store_act, density, specials, seed):
    """Any M and H (tails of a 128-column tile), every dtype, no / all / some active, NaN and Inf,
    rows whose tiles overflow the 16 slots."""
    layout = TwellLayout()
    pre, up = _operands(m, h, dtype, density, seed, specials)
    record = _record(calls=2.0)
    l1 = torch.zeros(1, dtype=torch.float32, device=DEV)
    hid, act = dense_activation(pre.to(DEV), up.to(DEV) if gated else None, store_act=store_act,
                                record=record, l1=l1, layout=layout)
    relu = torch.relu(pre)
    want = relu * up if gated else relu
    _assert_h(hid, want, dtype)
    assert hid.dtype == dtype and hid.shape == (m, h)
    if gated and store_act:
        assert torch.equal(act.cpu().nan_to_num(), relu.nan_to_num())
    elif gated:
        assert act is None
    else:
        assert act is hid
    active, over = _expected_counts(pre, layout)
    assert record.values.tolist() == [3.0, m, active, over, 0.0]
    assert record.scratch.tolist() == [0, 0, 0], "left zeroed for the next call"
    want_l1 = hid.cpu().double().abs().sum()  # of the h written (the interpreter rounds bf16 its own way)
    if torch.isfinite(want_l1):
        assert torch.allclose(l1.cpu().double(), want_l1, rtol=1e-4, atol=1e-4)
    else:
        assert not torch.isfinite(l1).item()


def test_small_layout_counts_overflow_per_tile():
    """A 4-column tile with 2 slots: a row overflows when one of its tiles has 3 active entries,
    not when the row as a whole has many."""
    layout = TwellLayout(tile_n=4, slots=2)
    pre = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0],  # 4 active, 2 per tile: no
                        [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0],  # 3 in the first tile: yes
                        [-1.0] * 7 + [float("nan")]])  # NaN counts as active
    record = _record()
    hid, act = dense_activation(pre.to(DEV), record=record, layout=layout)
    assert record.values.tolist() == [1.0, 3.0, 8.0, 1.0, 0.0]
    assert torch.equal(hid.cpu().nan_to_num(), torch.relu(pre).nan_to_num())


def _eager_backward(dh, h, act, coef, up):
    """Dense autograd's ops for this step, which ``twell_compile.lowering.dense_path.dense_backward``
    computes with the fused pass."""
    dh = dh.clone()
    dh.addcmul_(torch.sign(h), coef)
    threshold_backward = torch.ops.aten.threshold_backward
    if up is None:
        return None, threshold_backward(dh, act, 0)
    return threshold_backward(dh * up, act, 0), dh.mul_(act)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(0, 40), h=st.integers(1, 300), dtype=st.sampled_from(DTYPES), gated=st.booleans(),
       density=st.sampled_from([0.0, 0.02, 0.5, 1.0]), specials=st.booleans(), coef=st.sampled_from([0.0, 1e-3, 0.25]),
       seed=st.integers(0, 2**16))
@example(m=5, h=130, dtype=torch.bfloat16, gated=True, density=0.5, specials=True, coef=0.25, seed=0)
def test_backward_matches_eager_l1_threshold_and_products(m, h, dtype, gated, density, specials, coef, seed):
    """Every dtype and shape; NaN and Inf in the forward's values and in ``dh``; h of both signs and 0."""
    pre, up = _operands(m, h, dtype, density, seed, specials)
    act = torch.relu(pre)
    hid = act * up if gated else act
    gen = torch.Generator().manual_seed(seed + 1)
    dh = torch.randn(m, h, generator=gen).to(dtype)
    if specials and m and h:
        dh[-1, 0] = float("inf")
        dh[0, -1] = float("nan")
    coef_t = torch.tensor(coef, dtype=dtype)
    want_gate, want_up = _eager_backward(dh, hid, act, coef_t, up if gated else None)
    got_dh = dh.to(DEV)
    d_gate, d_up = dense_activation_backward(got_dh, hid.to(DEV), act.to(DEV), coef_t.to(DEV),
                                             up.to(DEV) if gated else None)
    assert d_up.data_ptr() == got_dh.data_ptr()  # written in place, as eager's dh.mul_(act)
    _assert_h(d_up, want_up, dtype, roundings=2)
    if gated:
        _assert_h(d_gate, want_gate, dtype, roundings=2)
    else:
        assert d_gate is None


def test_bad_arguments_name_the_argument():
    pre = torch.zeros(4, 6, device=DEV)
    with pytest.raises(ValueError, match="pre must be a 2-D"):
        dense_activation(pre[0])
    with pytest.raises(TypeError, match="up must have dtype"):
        dense_activation(pre, pre.half())
    with pytest.raises(ValueError, match="up must have shape"):
        dense_activation(pre, pre[:2])
    with pytest.raises(ValueError, match="record.values must be float64"):
        dense_activation(pre, record=CallRecord(torch.zeros(5, device=DEV), torch.zeros(3, dtype=torch.int64), 0.0))
    with pytest.raises(TypeError, match="pre must have dtype"):
        dense_activation(pre.int())
    coef = torch.tensor(0.1, device=DEV)
    with pytest.raises(ValueError, match="dh must be contiguous"):
        dense_activation_backward(pre.t(), pre.t(), pre.t(), coef)
    with pytest.raises(ValueError, match="coef must have shape"):
        dense_activation_backward(pre, pre, pre, coef.view(1))
    with pytest.raises(TypeError, match="act must have dtype"):
        dense_activation_backward(pre, pre, pre.double(), coef)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_benchmark_shape_is_bitwise_eager(dtype):
    """M=16384, H=5632 at ~2% density: bitwise equal to eager, exact counts."""
    pre, up = _operands(16384, 5632, dtype, 0.02, 1, True)
    pre, up = pre.cuda(), up.cuda()
    record = _record()
    hid, act = dense_activation(pre, up, store_act=True, record=record)
    relu = torch.relu(pre)
    torch.testing.assert_close(hid, relu * up, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(act, relu, rtol=0, atol=0, equal_nan=True)
    assert record.values.tolist() == [1.0, 16384.0, *_expected_counts(pre, TwellLayout()), 0.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_backward_at_benchmark_shape_is_bitwise_eager(gated):
    pre, up = _operands(16384, 5632, torch.bfloat16, 0.02, 2, True)
    pre, up = pre.cuda(), up.cuda()
    act = torch.relu(pre)
    hid = act * up if gated else act
    dh = torch.randn_like(pre)
    coef = torch.tensor(3e-4, dtype=torch.bfloat16, device="cuda")
    want_gate, want_up = _eager_backward(dh, hid, act, coef, up if gated else None)
    d_gate, d_up = dense_activation_backward(dh, hid, act, coef, up if gated else None)
    torch.testing.assert_close(d_up, want_up, rtol=0, atol=0, equal_nan=True)
    if gated:
        torch.testing.assert_close(d_gate, want_gate, rtol=0, atol=0, equal_nan=True)
