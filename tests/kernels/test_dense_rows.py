"""kernels/dense_rows.py: the device-built list of dense rows and the split scratch product.

Oracles: ``torch.nonzero`` for the lists (``dense_list``, and ``flag_rows``' last program's); ``coef @
W (+ bias)`` in float64 for the product (each output tile summed by its last split), for
every list position below ``n_dense``, with rows outside the list left untouched. (The forward and
backward kernel tests cover both pieces again inside ``sparse_ffn`` and ``sparse_ffn_backward``.)
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (DESIGN.md section 9)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from twell_compile.kernels import dense_rows as DR  # noqa: E402
from twell_compile.kernels import weights as W  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=12, deadline=None)
@given(m=st.integers(0, 1100), rate=st.sampled_from([0.0, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_dense_list_is_the_flagged_rows_in_order(m, rate, seed):
    """Any M, with no, few, many or all rows flagged."""
    gen = torch.Generator().manual_seed(seed)
    flags = (torch.rand(m, generator=gen) < rate).to(DEV)
    _assert_lists(DR.dense_list(flags), flags)


def _assert_lists(listed, flags):
    """``listed`` (a ``RowList``) holds exactly the rows ``flags`` sets, in increasing order."""
    expected = torch.nonzero(flags.cpu()).flatten().to(torch.int32)
    assert listed.n_dense.dtype == torch.int32 and listed.n_dense.shape == (1,)
    assert listed.n_dense.item() == expected.numel()
    assert torch.equal(listed.rows[: expected.numel()].cpu(), expected)


def _split_problem(gen, h=4096, d=512, r_cap=256):
    """A split-product problem on the GPU: 200 listed rows of ``r_cap + 40``, two planes of fp32
    coefficients ``[2, r_cap, h]`` and two ``[h, d]`` weights (16 splits at ``bh=16``)."""
    flags = torch.zeros(r_cap + 40, dtype=torch.bool)
    flags[torch.randperm(r_cap + 40, generator=gen)[:200]] = True
    rows, n_dense = DR.dense_list(flags.cuda())
    coef = torch.randn(2, r_cap, h, generator=gen).cuda()
    weights = [torch.randn(h, d, generator=gen).cuda() for _ in range(2)]
    return flags, rows, n_dense, coef, weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_lists_and_split_sums_by_the_last_program_at_scale():
    """The last program of a launch (a ticket) reads what every other program stored: many
    programs running at once, with every other row, a few rows or none flagged, several times
    over; and the split product's per-tile sums over 16 splits, against the two-launch form."""
    gen = torch.Generator().manual_seed(11)
    m, d = 65536, 64
    a = torch.randn(m, d, generator=gen).cuda()
    limit = float(torch.finfo(torch.float32).max)
    for rep, rate in enumerate((0.5, 0.003, 1e-5, 0.0) * 3):
        flagged = torch.rand(m, generator=gen) < rate
        a[flagged.cuda(), 0] = float("nan")
        a[~flagged.cuda(), 0] = 1.0
        flags, listed = DR.flag_rows(a, torch.tensor([0.0, 0.0, limit], device="cuda"), with_list=True)
        assert torch.equal(flags.cpu(), flagged), rep
        _assert_lists(listed, flagged)
    flags, rows, n_dense, coef, weights = _split_problem(gen)
    h, d, r_cap = coef.shape[2], weights[0].shape[1], coef.shape[1]
    bias = torch.randn(d, generator=gen).cuda()
    assert DR.split_count(h, 16) == 16
    for _ in range(3):
        dst = torch.zeros(r_cap + 40, d, device="cuda")
        DR.scratch_product(coef, rows, n_dense, weights, dst, bias, split=False, bh=16, bd=64, warps=4)
        listed = torch.nonzero(flags).flatten()
        ref = sum(coef[p, : len(listed)].double() @ w.double() for p, w in enumerate(weights)) + bias.double()
        assert torch.allclose(dst[listed.cuda()].double(), ref, rtol=1e-5, atol=1e-3)
        assert not dst[~flags.cuda()].any()


@pytest.mark.parametrize("two, split, dtype", [(True, False, torch.float32), (False, False, torch.float32),
                                               (True, True, torch.float16), (False, True, torch.bfloat16)])
def test_scratch_product_matches_float64(two, split, dtype):
    """``dst[rows[i]] = Σ_p coef[p, i] @ W_p (+ bias)`` over two H splits; other rows untouched."""
    gen = torch.Generator().manual_seed(3)
    m, d, h, r_cap = 40, 24, 200, 32  # bh = 16: split_count(200, 16) = 2 splits
    flags = torch.zeros(m, dtype=torch.bool)
    flags[[0, 5, 17, 18, 39]] = True
    rows, n_dense = DR.dense_list(flags.to(DEV))
    coef = torch.randn(2, r_cap, h, generator=gen)
    coef[:, 2, 7] = float("inf")  # hi + lo keeps Inf (lo is 0 there), as one IEEE product would
    weights = [torch.randn(h, d, generator=gen).to(dtype) for _ in range(2 if two else 1)]
    bias = torch.randn(d, generator=gen)
    dst = torch.full((m, d), 7.0, dtype=dtype)
    ours = dst.to(DEV)
    DR.scratch_product(coef.to(DEV), rows, n_dense, [w.to(DEV) for w in weights], ours, bias.to(DEV),
                       split=split, bh=16, bd=16, warps=4)
    ours = ours.cpu()
    listed = torch.nonzero(flags).flatten()
    ref = sum(coef[p, : len(listed)].double() @ w.double() for p, w in enumerate(weights)) + bias.double()
    untouched = ~flags
    assert torch.equal(ours[untouched], dst[untouched])
    got = ours[listed].double()
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.equal(torch.isnan(got), torch.isnan(ref))
    finite = torch.isfinite(ref)
    # One rounding to the output dtype; split products keep ~16 bits of each coefficient.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    scale = ref[finite].abs().max()
    assert ((got - ref)[finite].abs() <= tol * scale).all(), ((got - ref)[finite].abs().max() / scale).item()


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
    record = DR.CallRecord(torch.tensor([4.0, 7.0, 9.0, 9.0, 0.0], dtype=torch.float64, device=DEV),
                           torch.zeros(3, dtype=torch.int64, device=DEV), 1.0)
    dev_args = [t if t is None else t.to(DEV) for t in args]
    for calls in (5.0, 6.0):  # the scratch is left zeroed for the next call
        got, listed = DR.flag_rows(*dev_args, count=count.to(DEV), slots=slots, flag_overflow=overflow, record=record,
                                   with_list=True)
        assert record.values.tolist() == [calls, m, want_active.item(), want_dense.item(), 1.0]
        assert record.scratch.tolist() == [0, 0, 0]
    assert got.dtype == torch.bool and got.shape == (m,)
    assert torch.equal(got.cpu(), want)
    _assert_lists(listed, want)
    assert torch.equal(DR.flag_rows(*dev_args).cpu(), R.flag_rows_ref(*args)[0])  # norms only
    # Marks: each flagged row with no overflowed tile gets count[r, 0] = slots + 1, nothing else
    # changes, and the record counts the counts as they were.
    marked = count.to(DEV)
    DR.flag_rows(*dev_args, count=marked, slots=slots, record=record, mark=True)
    assert record.values.tolist()[2:4] == [want_active.item(), want_dense.item()]
    norm_rows = R.flag_rows_ref(*args)[0]
    expect = count.clone()
    expect[norm_rows & ~(count > slots).any(-1), 0] = slots + 1
    assert torch.equal(marked.cpu(), expect)
    dense = norm_rows | (count > slots).any(-1)  # what the marked counts alone now say
    assert torch.equal(R.flag_rows_ref(torch.zeros_like(a), a_bound, count=expect, slots=slots, flag_overflow=True)[0],
                       dense | ~(a_bound[1] < a_bound[2]))


def test_call_record_loses_nothing_when_another_launch_is_in_flight():
    """Two launches of one layer at once (two streams): this launch finds another's counts and
    ticket already in the scratch. Its record takes part of them, nothing is lost, and the ticket
    is left exactly as the other launch needs it to finish (interpreted programs run one by one,
    so the other launch's progress is set up by hand)."""
    m, n_tiles, slots = 64, 3, 3  # 4 programs of 16 rows
    a = torch.randn(m, 8)
    bound = torch.tensor([0.0, 0.0, 1e30])
    count = torch.full((m, n_tiles), 2, dtype=torch.int32)  # 6 actives per row, no overflow
    other_active, other_dense, other_ticket = 100, 3, 2  # two of the other launch's programs are in
    record = DR.CallRecord(torch.zeros(5, dtype=torch.float64, device=DEV),
                           torch.tensor([other_active, other_dense, other_ticket], dtype=torch.int64, device=DEV), 1.0)
    DR.flag_rows(a.to(DEV), bound.to(DEV), count=count.to(DEV), slots=slots, record=record)
    stored_active, stored_dense = record.values[2].item(), record.values[3].item()
    left_active, left_dense, left_ticket = record.scratch.tolist()
    assert stored_active + left_active == other_active + 6 * m
    assert stored_dense + left_dense == other_dense
    assert left_ticket == other_ticket


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_call_records_at_scale_hold_every_programs_counts():
    """``finish_call`` on the GPU, where its sums are relaxed atomics and only the ticket is
    acq_rel: the last of 16,384 ``flag_rows`` programs, and ``dense_list``'s one program, store
    exactly the call's active entries and dense rows, call after call, and leave the scratch
    zeroed."""
    gen = torch.Generator().manual_seed(34)
    m, n_tiles, slots = 262144, 44, 16
    a = torch.randn(m, 64, generator=gen)
    a[torch.rand(m, generator=gen) < 0.01, 3] = float("nan")
    count = torch.randint(0, 20, (m, n_tiles), generator=gen, dtype=torch.int32)
    bound = torch.tensor([0.0, 0.0, 1e30])
    want_dense = (a.isnan().any(1) | (count > slots).any(1)).sum().item()
    flags = torch.rand(100003, generator=gen) < 0.001
    row_counts = torch.randint(0, 60, (100003,), generator=gen, dtype=torch.int32)
    a, count, bound, flags, row_counts = (t.cuda() for t in (a, count, bound, flags, row_counts))
    record = DR.CallRecord(torch.zeros(5, dtype=torch.float64, device="cuda"),
                           torch.zeros(3, dtype=torch.int64, device="cuda"), 1.0)
    for calls in range(1, 21):
        DR.flag_rows(a, bound, count=count, slots=slots, flag_overflow=True, record=record)
        assert record.values.tolist() == [2 * calls - 1, m, count.sum().item(), want_dense, 1.0]
        assert record.scratch.tolist() == [0, 0, 0]
        listed = DR.dense_list(flags, record=record, row_counts=row_counts)
        assert record.values.tolist() == [2 * calls, 100003, row_counts.sum().item(), flags.sum().item(), 1.0]
        assert record.scratch.tolist() == [0, 0, 0]
        _assert_lists(listed, flags.cpu())


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
        fwd, bwd = W.guard_bounds(*(t if t is None else t.to(DEV) for t in w))
        ours, listed = DR.flag_rows(x.to(DEV), fwd, with_list=True)
        _assert_lists(listed, ours)
        ours = ours.cpu()
        ref = R.dense_rows_ref(x, *w, packed) & no_overflow
        assert bool((ours | ~ref).all()) and ours[[2, 5]].all() and not ours[[0, 1, 3]].any()
        assert bool(ours[7]) == gated
        back = DR.flag_rows(x.to(DEV), fwd, dout.to(DEV), bwd, packed.count.to(DEV), slots=packed.idx.shape[-1],
                            flag_overflow=True).cpu()
        ref = R.backward_dense_rows_ref(dout, x, *w, packed)
        assert bool((back | ~ref).all()) and back[9]
        assert back[11] if gated else torch.equal(back, ref)  # plain: finiteness and overflow only
    wd_bad = wd.clone()
    wd_bad[0, 0] = float("nan")
    fwd, _ = W.guard_bounds(wg.to(DEV), wu.to(DEV), wd_bad.to(DEV), None, bu.to(DEV), None)
    assert DR.flag_rows(x.to(DEV), fwd).all(), "a non-finite weight sends every row dense"


def test_scratch_capacity_covers_the_budget_and_the_dispatch_limit():
    """A multiple of BR rows: SCRATCH_BYTES' worth, or DENSE_ROW_FRACTION_MAX of the rows when
    that is more, never more than M rounded up; an explicit request wins (tests)."""
    per_row = 4 * 3 * 5632  # the backward's three fp32 coefficient planes at H = 5632
    budget = DR.SCRATCH_BYTES // per_row // DR.BR * DR.BR
    assert budget == 496
    assert DR.scratch_capacity(16384, per_row) == 496  # 2% of the rows: 336
    big = DR.scratch_capacity(65536, per_row)  # 2% is 1311
    assert big == 1312 and big % DR.BR == 0 and big >= DR.DENSE_ROW_FRACTION_MAX * 65536
    assert DR.scratch_capacity(100, per_row) == 112  # M rounded up to BR
    assert DR.scratch_capacity(16384, per_row, requested=20) == 32
    assert DR.scratch_capacity(16384, per_row, requested=0) == 0
    assert DR.scratch_capacity(16384, 1 << 40) == 336  # a tiny budget: still 2% of the rows


def test_kept_tickets_are_left_zeroed_and_change_nothing():
    """With ``reuse_tickets`` the list of ``flag_rows``, the split sums of ``scratch_product`` and
    ``guard_bounds`` take their tickets and counters from the kept buffer (``zeroed_scratch``):
    each launch, twice over, gives bitwise the results of a fresh zeroed buffer and leaves the
    kept one all zeros (the next launch on the stream relies on it)."""
    gen = torch.Generator().manual_seed(11)
    dev = torch.device(DEV)
    kept = DR.zeroed_scratch(1, dev, reuse=True)
    assert DR.zeroed_scratch(1, dev, reuse=True) is kept and not kept.any()
    assert DR.zeroed_scratch(1, dev, reuse=False) is not kept

    a = torch.randn(70, 12, generator=gen)
    a[[3, 40, 41, 69]] = float("nan")  # flagged rows in several programs
    bound = torch.tensor([1.0, 0.0, 1e30]).to(DEV)
    m, d, h, r_cap = 40, 24, 200, 32  # two H splits (test_scratch_product_matches_float64)
    rows, n_dense = DR.dense_list((torch.arange(m) % 7 == 0).to(DEV))
    coef = torch.randn(2, r_cap, h, generator=gen).to(DEV)
    weights = [torch.randn(h, d, generator=gen).to(DEV) for _ in range(2)]
    wg, wu = (torch.randn(h, d, generator=gen).to(DEV) for _ in range(2))
    wd, bu = torch.randn(d, h, generator=gen).to(DEV), torch.randn(h, generator=gen).to(DEV)

    def run(reuse):
        flags, listed = DR.flag_rows(a.to(DEV), bound, with_list=True, reuse_tickets=reuse)
        dst = torch.zeros(m, d, device=DEV)
        DR.scratch_product(coef, rows, n_dense, weights, dst, split=False, bh=16, bd=16, warps=4,
                           reuse_tickets=reuse)
        return [flags, listed.rows[: int(listed.n_dense)], dst,
                *W.guard_bounds(wg, wu, wd, None, bu, None, reuse_tickets=reuse)]

    fresh = run(False)
    for _ in range(2):
        again = run(True)
        assert all(torch.equal(x, y) for x, y in zip(again, fresh))
        assert not DR.zeroed_scratch(1, dev, reuse=True).any()


def test_kept_tickets_are_one_buffer_per_stream_and_bounded():
    """One kept buffer per (device, stream), grown when a launch needs more, the oldest dropped
    past ``_TICKETS_STREAMS``; a fresh zeroed one under ``reuse=False``."""
    dev = torch.device(DEV)
    DR._TICKETS.clear()
    small = DR.zeroed_scratch(3, dev, reuse=True)
    assert small.numel() >= 3 and not small.any()
    big = DR.zeroed_scratch(DR._TICKETS_MIN + 5, dev, reuse=True)
    assert big is not small and big.numel() >= DR._TICKETS_MIN + 5 and not big.any()
    assert DR.zeroed_scratch(3, dev, reuse=True) is big
    assert len(DR._TICKETS) == 1
    DR._TICKETS.clear()
    with pytest.MonkeyPatch.context() as mp:  # six other streams (stand-in keys), then this one
        mp.setattr(DR, "_TICKETS_STREAMS", 4)
        DR._TICKETS.update({("other stream", i): small for i in range(6)})
        kept = DR.zeroed_scratch(1, dev, reuse=True)
        assert list(DR._TICKETS) == [("other stream", 3), ("other stream", 4), ("other stream", 5), *[
            k for k in DR._TICKETS if k[0] == dev.type]]
        assert DR.zeroed_scratch(1, dev, reuse=True) is kept
    DR._TICKETS.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kept_tickets_on_two_streams_at_once():
    """Launches on two streams at once each take their own stream's kept buffer: many split sums
    (16 splits a tile), lists of 65,536-row guards and weight bounds queued on both streams with
    no sync between them give bitwise the results of fresh buffers, and leave both kept buffers
    zeroed."""
    gen = torch.Generator().manual_seed(12)
    flags, rows, n_dense, coef, weights = _split_problem(gen)
    h, d, r_cap = coef.shape[2], weights[0].shape[1], coef.shape[1]
    wg, wu = (torch.randn(h, d, generator=gen).bfloat16().cuda() for _ in range(2))
    wd = torch.randn(d, h, generator=gen).bfloat16().cuda()

    a = torch.randn(65536, 64, generator=gen).cuda()
    a[torch.rand(65536, generator=gen).cuda() < 0.3, 0] = float("nan")
    bound = torch.tensor([0.0, 0.0, float(torch.finfo(torch.float32).max)], device="cuda")

    def run(reuse):
        dst = torch.zeros(r_cap + 40, d, device="cuda")
        DR.scratch_product(coef, rows, n_dense, weights, dst, split=False, bh=16, bd=64, warps=4, reuse_tickets=reuse)
        flags, listed = DR.flag_rows(a, bound, with_list=True, reuse_tickets=reuse)
        return [dst, flags, listed, *W.guard_bounds(wg, wu, wd, None, None, None, reuse_tickets=reuse)]

    fresh = run(False)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = [[], []]
    for _ in range(8):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                results[i].append(run(True))
    torch.cuda.synchronize()
    def listed_rows(listed):  # entries past n_dense are unspecified
        return listed.rows[: int(listed.n_dense)]

    for per_stream in results:
        for got in per_stream:
            assert torch.equal(listed_rows(got[2]), listed_rows(fresh[2]))
            got, want = got[:2] + got[3:], fresh[:2] + fresh[3:]
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    for s in streams:
        with torch.cuda.stream(s):
            assert not DR.zeroed_scratch(1, torch.device("cuda"), reuse=True).any()
