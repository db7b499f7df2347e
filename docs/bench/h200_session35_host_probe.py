"""Session 35 probe (run 3; docs/benchmarks.md, "Session 35"): the inference op's host time a call,
custom_op (old) against torch.library.Library (new) twell::ffn, interleaved in one process, and the
bench's per-call protocol on both. On a GPU machine, from the repository root:
python3 docs/bench/h200_session35_host_probe.py"""
import statistics, time
from typing import Optional
import torch
from torch import Tensor
import twell_compile.lowering  # noqa: F401
from twell_compile import bench as B
from twell_compile.lowering import cuda_impl, impl
from twell_compile.lowering.checks import check_ffn_args
from twell_compile.kernels.gate_pack import gate_pack
from twell_compile.kernels.sparse_ffn import sparse_ffn


@torch.library.custom_op("twellold::ffn", mutates_args=(), tags=(torch.Tag.needs_contiguous_strides,))
def old_ffn(x: Tensor, wg: Optional[Tensor], wu: Tensor, wd: Tensor, bg: Optional[Tensor], bu: Optional[Tensor],
            bd: Optional[Tensor], layer: int) -> Tensor:
    check_ffn_args(x, wg, wu, wd, bg, bu, bd)
    res = impl.forward(impl.flatten_tokens(x), wg, wu, wd, bg, bu, bd, layer=layer, training=False)
    return res.out.reshape(x.shape)


@old_ffn.register_fake
def _(x, wg, wu, wd, bg, bu, bd, layer):
    return torch.empty_like(x)


torch.backends.cuda.matmul.allow_tf32 = True


def sleep_ms(ms):
    torch.cuda._sleep(int(ms * 1e-3 * 2.0e9))


def host_once(fn, n=30):
    torch.cuda.synchronize(); sleep_ms(3 * n + 20)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def forced(fn):
    def call():
        cuda_impl.FORCE_PATH = "sparse"
        try:
            return fn()
        finally:
            cuda_impl.FORCE_PATH = None
    return call


def host_table(density, skewed):
    x, wg, wu, wd = B.make_problem(16384, 2048, 5632, density, skewed=skewed)
    prep = cuda_impl._WeightPrep.get(wg, wu, wd, None, None, None)
    fb, _, wd_rows = prep
    from twell_compile.lowering import telemetry
    record = telemetry.call_record(20_000, x.device, True)
    packed = gate_pack(x, wg, None, paired=True)
    variants = {
        "new op, forced (torch.ops.twell.ffn)": forced(lambda: torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, 20_001)),
        "old op, forced (custom_op)": forced(lambda: torch.ops.twellold.ffn(x, wg, wu, wd, None, None, None, 20_002)),
        "new op, dispatched": lambda: torch.ops.twell.ffn(x, wg, wu, wd, None, None, None, 20_003),
        "old op, dispatched": lambda: torch.ops.twellold.ffn(x, wg, wu, wd, None, None, None, 20_004),
        "cuda_impl.forward, forced": forced(lambda: cuda_impl.forward(x, wg, wu, wd, None, None, None, layer=20_005, training=False)),
        "_sparse_forward": lambda: cuda_impl._sparse_forward(x, wg, wu, wd, None, None, None, False, False, record, prep=prep),
        "gate_pack": lambda: gate_pack(x, wg, None, paired=True),
        "sparse_ffn (+ list, dense-row launches)": lambda: sparse_ffn(x, packed, wu, wd_rows, None, None, wg=wg, bg=None,
                                                                      guard_bound=fb, record=record, mark=True, reuse_tickets=True),
        "dense FFN (PyTorch)": lambda: B.dense_ffn(x, wg, wu, wd),
    }
    with torch.no_grad():
        for fn in variants.values():
            for _ in range(6):
                fn()
        torch.cuda.synchronize()
        res = {k: [] for k in variants}
        for r in range(9):
            for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                res[k].append(host_once(variants[k]))
    print(f"host us a call, {'skewed' if skewed else 'uniform'} {density:.1%} (9 interleaved rounds of 30 calls, GPU kept busy)", flush=True)
    for k, v in res.items():
        print(f"  {k:42s} min {min(v):7.1f}  median {statistics.median(v):7.1f}", flush=True)
    # the bench's protocol (interleaved_ms): per-call times, old against new
    with torch.no_grad():
        t = B.interleaved_ms({
            "dense eager": lambda: B.dense_ffn(x, wg, wu, wd),
            "new dispatched": variants["new op, dispatched"],
            "old dispatched": variants["old op, dispatched"],
            "new forced": variants["new op, forced (torch.ops.twell.ffn)"],
            "old forced": variants["old op, forced (custom_op)"],
        }, reps=20)
    print("  bench protocol, ms a call: " + ", ".join(f"{k} {v:.3f} ({t['dense eager'] / v:.2f}x)" for k, v in t.items()), flush=True)
    with torch.no_grad():
        ref = B.dense_ffn(x.double(), wg.double(), wu.double(), wd.double())
        a = variants["new op, forced (torch.ops.twell.ffn)"]()
        b = variants["old op, forced (custom_op)"]()
        c = variants["new op, dispatched"]()
    print(f"  new == old forced bitwise: {torch.equal(a, b)}; dispatched == forced: {torch.equal(a, c)}; "
          f"rel err {B.rel_error(a, ref):.3e}", flush=True)


print(torch.cuda.get_device_name(), torch.__version__, flush=True)
for density, skewed in [(0.005, False), (0.003, False), (0.003, True), (0.005, True)]:
    host_table(density, skewed)
