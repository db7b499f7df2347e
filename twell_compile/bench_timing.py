"""How ``twell bench`` times things: interleaved samples with L2 flushes, CUDA-graph replays,
peak memory, and errors against float64 (docs/benchmarks.md, "Method")."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def weights_updated(weights) -> None:
    """Bump the weights' version counters, as an optimizer's in-place update does (no GPU work):
    caches keyed on them are rebuilt by the next step."""
    for w in weights:
        torch.autograd.graph.increment_version(w)


# Bytes written before each timed call to evict the L2 (the H200's is 60 MiB), as
# triton.testing.do_bench does (256 MB).
L2_FLUSH_BYTES = 256 * 2**20


def interleaved_ms(fns: dict[str, Callable[[], object]], *, warmup: int = 5, reps: int = 20,
                   calls: int = 5) -> dict[str, float]:
    """Each of ``fns``' median per-call time over ``reps`` samples of ``calls`` calls.

    * Interleaved: round ``r`` samples every provider once, in the given order for even ``r`` and
      in reverse for odd ones: under sustained GEMM load the H200's SM clock drops (1.80 -> 1.53
      GHz at ~690 W), which would slow whichever provider ran later.
    * A wait before each sample: the host starts level with the GPU, so no provider spends a lead
      the host built during another's samples.
    * Each call follows an L2 flush and has its own CUDA events, back to back with no wait, as
      ``triton.testing.do_bench`` times them: a layer in a model finds its weights evicted by
      other layers' work, and within a sample the host runs ahead as it does through a model, so a
      provider's host work shows only where it exceeds its GPU work (the flush, ~0.08 ms of GPU
      work on the H200, also gives the host that much of a head start on each call, as other
      layers' work does in a model). The median over the ``reps * calls`` values discounts each
      sample's first call, which carries the host's head start from the wait. For a host-bound
      provider the median is noisy: up to ~25% above its back-to-back pace on the H200's hosts.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for name in (names if r % 2 == 0 else names[::-1]):
            events = []
            for _ in range(calls):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                flush.zero_()
                start.record()
                fns[name]()
                end.record()
                events.append((start, end))
            torch.cuda.synchronize()
            times[name] += [start.elapsed_time(end) for start, end in events]
    return {name: statistics.median(t) for name, t in times.items()}


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in one CUDA graph; returns its replay. Warm-up calls run first on a side
    stream (as ``torch.cuda.graphs`` asks), which also tunes and compiles every kernel. A replay
    costs the host one launch, so the GPU's time is all that is timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def peak_mb(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20
