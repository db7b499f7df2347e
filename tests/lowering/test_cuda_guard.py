"""The CUDA path's finiteness guard (``lowering/cuda_impl.py``) is plain torch code: check it on CPU.

It must flag at least every row the reference guard flags (a superset only costs speed), and
its weight facts must be recomputed when a weight changes in place.
"""

import torch

from twell_compile.kernels import reference as R
from twell_compile.lowering import cuda_impl


def _ffn(m=12, d=16, h=40, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g).to(dtype)
    wg, wu = (torch.randn(h, d, generator=g).to(dtype) for _ in range(2))
    wd = torch.randn(d, h, generator=g).to(dtype)
    bu = torch.randn(h, generator=g).to(dtype)
    return x, wg, wu, wd, None, bu, None


def _reference_guard(x, wg, wu, wd, bg, bu, bd):
    packed = R.gate_pack_ref(x, wg, bg)
    return R.dense_rows_ref(x, wg, wu, wd, bg, bu, bd, packed) & ~packed.overflow_rows()


def test_guard_flags_nonfinite_and_overflowing_rows():
    x, wg, wu, wd, bg, bu, bd = _ffn()
    x[2, 3] = float("nan")
    x[5, 0] = float("inf")
    x[7] = 3e4  # fp16 up projection may overflow
    got = cuda_impl._guard_rows(x, wg, wu, wd, bg, bu, bd)
    ref = _reference_guard(x, wg, wu, wd, bg, bu, bd)
    assert got[[2, 5, 7]].all()
    assert bool((got | ~ref).all()), "every reference guard row must be flagged"
    assert not got[[0, 1, 3]].any()


def test_guard_plain_ffn_flags_only_nonfinite_rows():
    x, _, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
    x[4, 1] = float("nan")
    got = cuda_impl._guard_rows(x, None, wu, wd, None, bu, bd)
    assert got.tolist() == [i == 4 for i in range(x.shape[0])]


def test_weight_facts_follow_in_place_updates():
    x, wg, wu, wd, bg, bu, bd = _ffn(dtype=torch.float32)
    assert not cuda_impl._guard_rows(x, wg, wu, wd, bg, bu, bd).any()
    wd[0, 0] = float("inf")  # bumps wd._version: the cached facts must not be reused
    assert cuda_impl._guard_rows(x, wg, wu, wd, bg, bu, bd).all()


def test_weight_facts_work_for_inference_mode_tensors():
    with torch.inference_mode():
        x, wg, wu, wd, bg, bu, bd = _ffn(dtype=torch.float32)
        assert not cuda_impl._guard_rows(x, wg, wu, wd, bg, bu, bd).any()


def test_backward_guard_adds_dout_rows_and_overflow_rows():
    x, wg, wu, wd, bg, bu, bd = _ffn(dtype=torch.float32)
    packed = R.gate_pack_ref(x, wg, bg)
    dout = torch.randn_like(x)
    dout[3, 2] = float("nan")
    got = cuda_impl._backward_guard_rows(dout, x, wg, wu, wd, bg, bu, bd, packed)
    ref = R.backward_dense_rows_ref(dout, x, wg, wu, wd, bg, bu, bd, packed)
    assert bool((got | ~ref).all())
    assert got[3]
