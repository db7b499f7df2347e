"""kernels/tickets.py: the last program of a launch, the call records it stores, and kept tickets.

A call record loses no count when two launches of one layer overlap; on the GPU the last program
of many sees every other program's counts; kept ticket buffers (``zeroed_scratch(reuse=True)``)
are one per stream, left zeroed by every launch that uses them, and change no result.
"""

from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.kernels.dense_row_cases import assert_lists, split_problem  # noqa: E402
from twell_compile.kernels.dense_rows import scratch_product  # noqa: E402
from twell_compile.kernels.row_lists import dense_list, flag_rows  # noqa: E402
from twell_compile.kernels.tickets import KEPT_TICKETS_MIN, CallRecord, zeroed_scratch  # noqa: E402
from twell_compile.kernels.weights import guard_bounds  # noqa: E402

TK = importlib.import_module("twell_compile.kernels.tickets")  # the module itself: tests patch its state

DEV = "cuda" if torch.cuda.is_available() else "cpu"


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
    record = CallRecord(torch.zeros(5, dtype=torch.float64, device=DEV),
                           torch.tensor([other_active, other_dense, other_ticket], dtype=torch.int64, device=DEV), 1.0)
    flag_rows(a.to(DEV), bound.to(DEV), count=count.to(DEV), slots=slots, record=record)
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
    record = CallRecord(torch.zeros(5, dtype=torch.float64, device="cuda"),
                           torch.zeros(3, dtype=torch.int64, device="cuda"), 1.0)
    for calls in range(1, 21):
        flag_rows(a, bound, count=count, slots=slots, flag_overflow=True, record=record)
        assert record.values.tolist() == [2 * calls - 1, m, count.sum().item(), want_dense, 1.0]
        assert record.scratch.tolist() == [0, 0, 0]
        listed = dense_list(flags, record=record, row_counts=row_counts)
        assert record.values.tolist() == [2 * calls, 100003, row_counts.sum().item(), flags.sum().item(), 1.0]
        assert record.scratch.tolist() == [0, 0, 0]
        assert_lists(listed, flags.cpu())

def test_kept_tickets_are_left_zeroed_and_change_nothing():
    """With ``reuse_tickets`` the list of ``flag_rows``, the split sums of ``scratch_product`` and
    ``guard_bounds`` take their tickets and counters from the kept buffer (``zeroed_scratch``):
    each launch, twice over, gives bitwise the results of a fresh zeroed buffer and leaves the
    kept one all zeros (the next launch on the stream relies on it)."""
    gen = torch.Generator().manual_seed(11)
    dev = torch.device(DEV)
    kept = zeroed_scratch(1, dev, reuse=True)
    assert zeroed_scratch(1, dev, reuse=True) is kept and not kept.any()
    assert zeroed_scratch(1, dev, reuse=False) is not kept

    a = torch.randn(70, 12, generator=gen)
    a[[3, 40, 41, 69]] = float("nan")  # flagged rows in several programs
    bound = torch.tensor([1.0, 0.0, 1e30]).to(DEV)
    m, d, h, r_cap = 40, 24, 200, 32  # two H splits (test_scratch_product_matches_float64)
    rows, n_dense = dense_list((torch.arange(m) % 7 == 0).to(DEV))
    coef = torch.randn(2, r_cap, h, generator=gen).to(DEV)
    weights = [torch.randn(h, d, generator=gen).to(DEV) for _ in range(2)]
    wg, wu = (torch.randn(h, d, generator=gen).to(DEV) for _ in range(2))
    wd, bu = torch.randn(d, h, generator=gen).to(DEV), torch.randn(h, generator=gen).to(DEV)

    def run(reuse):
        flags, listed = flag_rows(a.to(DEV), bound, with_list=True, reuse_tickets=reuse)
        dst = torch.zeros(m, d, device=DEV)
        scratch_product(coef, rows, n_dense, weights, dst, split=False, bh=16, bd=16, warps=4,
                           reuse_tickets=reuse)
        return [flags, listed.rows[: int(listed.n_dense)], dst,
                *guard_bounds(wg, wu, wd, None, bu, None, reuse_tickets=reuse)]

    fresh = run(False)
    for _ in range(2):
        again = run(True)
        assert all(torch.equal(x, y) for x, y in zip(again, fresh))
        assert not zeroed_scratch(1, dev, reuse=True).any()

def test_kept_tickets_are_one_buffer_per_stream_and_bounded():
    """One kept buffer per (device, stream), grown when a launch needs more, the oldest dropped
    past ``KEPT_TICKETS_STREAMS``; a fresh zeroed one under ``reuse=False``."""
    dev = torch.device(DEV)
    TK.KEPT_TICKETS.clear()
    small = zeroed_scratch(3, dev, reuse=True)
    assert small.numel() >= 3 and not small.any()
    big = zeroed_scratch(KEPT_TICKETS_MIN + 5, dev, reuse=True)
    assert big is not small and big.numel() >= KEPT_TICKETS_MIN + 5 and not big.any()
    assert zeroed_scratch(3, dev, reuse=True) is big
    assert len(TK.KEPT_TICKETS) == 1
    TK.KEPT_TICKETS.clear()
    with pytest.MonkeyPatch.context() as mp:  # six other streams (stand-in keys), then this one
        mp.setattr(TK, "KEPT_TICKETS_STREAMS", 4)
        TK.KEPT_TICKETS.update({("other stream", i): small for i in range(6)})
        kept = zeroed_scratch(1, dev, reuse=True)
        assert list(TK.KEPT_TICKETS) == [("other stream", 3), ("other stream", 4), ("other stream", 5), *[
            k for k in TK.KEPT_TICKETS if k[0] == dev.type]]
        assert zeroed_scratch(1, dev, reuse=True) is kept
    TK.KEPT_TICKETS.clear()

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kept_tickets_on_two_streams_at_once():
    """Launches on two streams at once each take their own stream's kept buffer: many split sums
    (16 splits a tile), lists of 65,536-row guards and weight bounds queued on both streams with
    no sync between them give bitwise the results of fresh buffers, and leave both kept buffers
    zeroed."""
    gen = torch.Generator().manual_seed(12)
    flags, rows, n_dense, coef, weights = split_problem(gen)
    h, d, r_cap = coef.shape[2], weights[0].shape[1], coef.shape[1]
    wg, wu = (torch.randn(h, d, generator=gen).bfloat16().cuda() for _ in range(2))
    wd = torch.randn(d, h, generator=gen).bfloat16().cuda()

    a = torch.randn(65536, 64, generator=gen).cuda()
    a[torch.rand(65536, generator=gen).cuda() < 0.3, 0] = float("nan")
    bound = torch.tensor([0.0, 0.0, float(torch.finfo(torch.float32).max)], device="cuda")

    def run(reuse):
        dst = torch.zeros(r_cap + 40, d, device="cuda")
        scratch_product(coef, rows, n_dense, weights, dst, split=False, bh=16, bd=64, warps=4, reuse_tickets=reuse)
        flags, listed = flag_rows(a, bound, with_list=True, reuse_tickets=reuse)
        return [dst, flags, listed, *guard_bounds(wg, wu, wd, None, None, None, reuse_tickets=reuse)]

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
            assert not zeroed_scratch(1, torch.device("cuda"), reuse=True).any()
