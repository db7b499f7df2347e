"""kernels/row_lists.py: the rows to compute densely, flagged and listed on the device.

Oracles: ``torch.nonzero`` for the lists (``dense_list``, and ``flag_rows``' last program's);
``reference.flag_rows_ref`` for the flags, the marks and the call record; ``reference.dense_rows_ref``
and ``backward_dense_rows_ref`` for the guard built from ``weights.guard_bounds``.
"""

from __future__ import annotations

import os
import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.kernels.dense_row_cases import assert_lists  # noqa: E402
from twell_compile.kernels.row_lists import dense_list, flag_rows  # noqa: E402
from twell_compile.kernels.tickets import CallRecord  # noqa: E402
from twell_compile.kernels.weights import guard_bounds  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=12, deadline=None)
@given(m=st.integers(0, 1100), rate=st.sampled_from([0.0, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_dense_list_is_the_flagged_rows_in_order(m, rate, seed):
    """Any M, with no, few, many or all rows flagged."""
    gen = torch.Generator().manual_seed(seed)
    flags = (torch.rand(m, generator=gen) < rate).to(DEV)
    assert_lists(dense_list(flags), flags)

_SPECIALS = st.sampled_from(["none", "nan", "inf", "huge"])

@settings(max_examples=20, deadline=None)
@given(m=st.integers(0, 70), d=st.integers(0, 300), n_tiles=st.integers(1, 5), two=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), special=_SPECIALS,
       gated=st.booleans(), finite_weights=st.booleans(), overflow=st.booleans(), seed=st.integers(0, 2**16))
@example(m=1, d=1, n_tiles=1, two=False, dtype=torch.float32, special="huge", gated=False, finite_weights=True,
         overflow=False, seed=0)  # its square overflows fp32: flagged (a CPU float64-accumulated norm would not)
def test_flag_rows_matches_reference(m, d, n_tiles, two, dtype, special, gated, finite_weights, overflow, seed):
    """Flags and the call record of ``flag_rows`` against ``reference.flag_rows_ref``: any M and D
    (not multiples of the block), NaN/Inf/huge rows, plain and gated bounds, non-finite weights."""
    from twell_compile.kernels import reference as R

    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, d, generator=gen).to(dtype)
    b = torch.randn(m, d, generator=gen).to(dtype)
    if m and d:
        row = int(torch.randint(0, m, (1,), generator=gen))
        value = {"none": 1.0, "nan": float("nan"), "inf": float("-inf"), "huge": torch.finfo(dtype).max / 4}[special]
        a[row, d // 2] = value
        b[(row + 1) % m, 0] = value
    limit = torch.finfo(dtype).max
    offset = 0.5 if finite_weights else float("inf")
    a_bound = torch.tensor([float(d) if gated else 0.0, offset, limit], dtype=torch.float32)
    b_bound = torch.tensor([2.0 if gated else 0.0, 0.0, limit], dtype=torch.float32)
    count = torch.randint(0, 5, (m, n_tiles), generator=gen, dtype=torch.int32)
    slots = 3
    args = (a, a_bound) + ((b, b_bound) if two else (None, None))
    want, (want_active, want_dense) = R.flag_rows_ref(*args, count=count, slots=slots, flag_overflow=overflow)
    record = CallRecord(torch.tensor([4.0, 7.0, 9.0, 9.0, 0.0], dtype=torch.float64, device=DEV),
                           torch.zeros(3, dtype=torch.int64, device=DEV), 1.0)
    dev_args = [t if t is None else t.to(DEV) for t in args]
    for calls in (5.0, 6.0):  # the scratch is left zeroed for the next call
        got, listed = flag_rows(*dev_args, count=count.to(DEV), slots=slots, flag_overflow=overflow, record=record,
                                   with_list=True)
        assert record.values.tolist() == [calls, m, want_active.item(), want_dense.item(), 1.0]
        assert record.scratch.tolist() == [0, 0, 0]
    assert got.dtype == torch.bool and got.shape == (m,)
    assert torch.equal(got.cpu(), want)
    assert_lists(listed, want)
    assert torch.equal(flag_rows(*dev_args).cpu(), R.flag_rows_ref(*args)[0])  # norms only
    # Marks: each flagged row with no overflowed tile gets count[r, 0] = slots + 1, nothing else
    # changes, and the record counts the counts as they were.
    marked = count.to(DEV)
    flag_rows(*dev_args, count=marked, slots=slots, record=record, mark=True)
    assert record.values.tolist()[2:4] == [want_active.item(), want_dense.item()]
    norm_rows = R.flag_rows_ref(*args)[0]
    expect = count.clone()
    expect[norm_rows & ~(count > slots).any(-1), 0] = slots + 1
    assert torch.equal(marked.cpu(), expect)
    dense = norm_rows | (count > slots).any(-1)  # what the marked counts alone now say
    assert torch.equal(R.flag_rows_ref(torch.zeros_like(a), a_bound, count=expect, slots=slots, flag_overflow=True)[0],
                       dense | ~(a_bound[1] < a_bound[2]))

def test_guard_bounds_flag_what_the_reference_guard_flags():
    """``guard_bounds`` + ``flag_rows`` flag every row ``dense_rows_ref`` flags without an
    overflow (a superset only costs speed), and the reference's backward ``dout`` rows."""
    from twell_compile.kernels import reference as R

    gen = torch.Generator().manual_seed(5)
    m, d, h = 24, 16, 40
    x = torch.randn(m, d, generator=gen).half()
    dout = torch.randn(m, d, generator=gen).half()
    wg, wu = (torch.randn(h, d, generator=gen).half() for _ in range(2))
    wd = torch.randn(d, h, generator=gen).half()
    bu = torch.randn(h, generator=gen).half()
    x[2, 3], x[5, 0], x[7] = float("nan"), float("inf"), 3e4  # x[7]: its fp16 up may overflow
    dout[9, 1], dout[11] = float("nan"), 2e4
    packed = R.gate_pack_ref(x, wg, None)
    no_overflow = ~packed.overflow_rows()
    for gated in (True, False):
        w = (wg if gated else None, wu, wd, None, bu, None)
        fwd, bwd = guard_bounds(*(t if t is None else t.to(DEV) for t in w))
        ours, listed = flag_rows(x.to(DEV), fwd, with_list=True)
        assert_lists(listed, ours)
        ours = ours.cpu()
        ref = R.dense_rows_ref(x, *w, packed) & no_overflow
        assert bool((ours | ~ref).all()) and ours[[2, 5]].all() and not ours[[0, 1, 3]].any()
        assert bool(ours[7]) == gated
        back = flag_rows(x.to(DEV), fwd, dout.to(DEV), bwd, packed.count.to(DEV), slots=packed.idx.shape[-1],
                            flag_overflow=True).cpu()
        ref = R.backward_dense_rows_ref(dout, x, *w, packed)
        assert bool((back | ~ref).all()) and back[9]
        assert back[11] if gated else torch.equal(back, ref)  # plain: finiteness and overflow only
    wd_bad = wd.clone()
    wd_bad[0, 0] = float("nan")
    fwd, _ = guard_bounds(wg.to(DEV), wu.to(DEV), wd_bad.to(DEV), None, bu.to(DEV), None)
    assert flag_rows(x.to(DEV), fwd).all(), "a non-finite weight sends every row dense"
