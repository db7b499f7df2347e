"""Session 32's probe (not part of the package): a warp-specialized ping-pong GEMM in Gluon.

Question: can Triton 3.6 on the H200 run a GEMM whose epilogue hides under the MMAs, which
``gate_pack``'s TwELL epilogue cannot (docs/benchmarks.md, "Session 32")? The kernel computes
``relu(x @ Wᵀ)`` in bf16 with explicit warp specialization (``gl.warp_specialize``):

* the default partition (4 warps, one thread issuing) loads x and W tiles by TMA into a ring of
  ``STAGES`` shared-memory slots, with a ``ready`` and an ``empty`` mbarrier per slot;
* two 4-warp consumer partitions take this program's tiles in turn (even and odd), each one
  warpgroup of ``wgmma`` on a 128x128 fp32 accumulator, so one's epilogue runs while the other
  multiplies (``consumers=1``: one consumer takes every tile, for comparison);
* the consumers also take turns on the main loop (``turn`` barriers). Without them a consumer
  could wait on a slot two fills ahead of the one it needs, whose phase parity is the same, and
  read it early: the first version faulted ("unspecified launch failure") under load, and ran
  clean under compute-sanitizer, which serialises it.

A Gluon 3.6 constraint met on the way: a worker partition's arguments must be IR values (no
constexprs, no Python ints: sizes come from the buffers' types).

Run on an H200: ``python docs/bench/h200_session32_gluon_pingpong.py``. Session 32's runs 4–7
used two kernels, one per consumer count; they are merged here under ``CONSUMERS`` (run 8 ran
this file). Its numbers, and how noisy they are: docs/benchmarks.md, "Session 32".

Written after session 32's last GPU run, and run in session 33 (docs/bench/h200_session33_probes.log,
run 1; docs/benchmarks.md, "Session 33"):

* ``epi=3`` packs TwELL as ``gate_pack`` does (bit ranks, paired slots); ``main`` checks it
  against ``gate_pack`` (equal counts, columns and values for all three variants) and times it:
  the ping-pong hides the epilogue (0.595-0.602 ms against 0.655-0.679 with one consumer) but
  ends 0.01-0.02 ms behind ``gate_pack`` (0.584-0.587), whose 256-row tiles read a quarter fewer
  operand bytes from L2 (4.4 GB a call against 5.9);
* ``rings=2``: one ring of ``STAGES // 2`` slots per consumer and no turns, so that both
  consumers can multiply at once: exact, and slower (0.695-0.725 ms).

To compile on a machine without a GPU, use ``GluonASTSource`` (``triton.experimental.gluon.
_runtime``), which sets the module's warp count and register cap before parsing, as the launch
does: the plain ``ASTSource`` fails to verify layouts outside worker partitions, and the kernel it
builds differs from the launched one (a forced ``wgmma`` wait, a stack frame).
"""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GROUP = gl.constexpr(8)  # row-blocks per group of the tile order, as gate_pack
SLOTS = gl.constexpr(16)  # TwELL slots per 128-column tile (format.DEFAULT_LAYOUT)


@gluon.jit
def _tile_coords(t, M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    group_m = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_m
    pid_n = (t % per_group) // group_m
    return pid_m * BM, pid_n * BN


@gluon.jit
def _schedule(M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """This program's first tile, the tile stride, the tiles and the K steps of a tile."""
    return gl.program_id(0), gl.num_programs(0), gl.cdiv(M, BM) * gl.cdiv(N, BN), gl.cdiv(K, BK)


@gluon.jit
def _slot(n, kk, ksteps, RINGS, STAGES: gl.constexpr):
    """Ring slot and mbarrier phase of K step ``kk`` of this program's ``n``-th tile. One ring
    (RINGS 1): the tiles' steps in order over all ``STAGES`` slots. Two rings (RINGS 2, two
    consumers): tile ``n`` in ring ``n % 2``, ``STAGES // 2`` slots each."""
    per_ring = STAGES // RINGS
    step = (n // RINGS) * ksteps + kk
    return (n % RINGS) * per_ring + step % per_ring, (step // per_ring) & 1


@gluon.jit
def _consume(a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, c_ptr, pk_ptr, cnt_ptr, M, N, K, EPI, RINGS, PARITY):
    # constexprs do not cross into worker partitions: sizes come from the buffers' types
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    pid, nprog, num_tiles, ksteps = _schedule(M, N, K, BM, BN, BK)
    n = 0
    for t in range(pid, num_tiles, nprog):
        if (PARITY < 0) | (n % 2 == PARITY):  # PARITY -1: every tile (one consumer)
            off_m, off_n = _tile_coords(t, M, N, BM, BN, GROUP)
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
            # The consumers take turns on the main loop (A's j-th, B's j-th, A's j+1-th, ...): a
            # consumer that ran ahead would wait on a slot two fills behind, whose phase parity aliases.
            # (With one ring per consumer, RINGS == 2, no slot is shared and no turn is needed.)
            j = n // 2
            if (PARITY == 0) & (RINGS == 1):
                mbarrier.wait(turn.index(1), (j + 1) & 1, pred=j > 0)
            elif (PARITY == 1) & (RINGS == 1):
                mbarrier.wait(turn.index(0), j & 1)
            for kk in range(ksteps):
                slot, phase = _slot(n, kk, ksteps, RINGS, STAGES)
                mbarrier.wait(ready.index(slot), phase)
                acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                prev, _ = _slot(n, kk - 1, ksteps, RINGS, STAGES)
                mbarrier.arrive(empty.index(prev), pred=kk > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            last, _ = _slot(n, ksteps - 1, ksteps, RINGS, STAGES)
            mbarrier.arrive(empty.index(last))
            if (PARITY >= 0) & (RINGS == 1):
                mbarrier.arrive(turn.index(PARITY))
            rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
            cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
            out = gl.maximum(acc, 0.0).to(gl.bfloat16)
            ptrs = c_ptr + rows[:, None] * N + cols[None, :]
            if EPI == 3:
                # TwELL, as gate_pack's bit-rank epilogue (kernels/gate_pack.py: _bit_ranks,
                # _store_slot_pairs), written inline: a jit helper that builds a tensor has no
                # warp count inside a worker partition.
                col_l: gl.constexpr = gl.SliceLayout(0, mma_layout)
                c = gl.arange(0, BN, layout=col_l)
                lane = (c % 32).to(gl.uint32)
                active = ((acc <= 0.0) == 0) & (cols[None, :] < N)  # not (pre <= 0): NaN is active
                bits = active.to(gl.uint32) << lane[None, :]
                word_b = gl.full((BM, BN), 0, gl.uint32, layout=mma_layout)
                before_b = gl.full((BM, BN), 0, gl.int32, layout=mma_layout)
                count = gl.full((BM, ), 0, gl.int32, layout=gl.SliceLayout(1, mma_layout))
                for wi in gl.static_range(BN // 32):
                    in_word = (c // 32 == wi)[None, :]
                    word = gl.sum(gl.where(in_word, bits, 0), axis=1)  # distinct bits: their sum is their or
                    word_b = gl.where(in_word, word[:, None], word_b)
                    before_b = gl.where(in_word, count[:, None], before_b)
                    count += gl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [word.to(gl.int32, bitcast=True)],
                                                       dtype=gl.int32, is_pure=True, pack=1)
                below = (gl.full((BN, ), 1, gl.uint32, layout=col_l) << lane) - 1
                rank = before_b + gl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r",
                                                            [(word_b & below[None, :]).to(gl.int32, bitcast=True)],
                                                            dtype=gl.int32, is_pure=True, pack=1)
                keep = active & (rank < SLOTS) & (rows[:, None] < M)
                n_tiles = gl.cdiv(N, BN)
                tile = off_n // BN
                rows64 = rows.to(gl.int64)
                pair_row = (pk_ptr + 2 * (rows64 * (n_tiles * SLOTS) + tile * SLOTS)).to(gl.int64, bitcast=True)
                col = cols[None, :] + rank * 0
                gl.inline_asm_elementwise(
                    """{
                    .reg .pred p;
                    .reg .s64 a;
                    setp.ne.s32 p, $5, 0;
                    mul.wide.s32 a, $2, 8;
                    add.s64 a, a, $1;
                    @p st.global.b32 [a], $3;
                    @p st.global.b32 [a+4], $4;
                    mov.b32 $0, 0;
                    }""",
                    "=r,l,r,r,r,r",
                    [pair_row[:, None] + rank.to(gl.int64) * 0, rank, col, acc.to(gl.int32, bitcast=True),
                     keep.to(gl.int32)],
                    dtype=gl.int32, is_pure=False, pack=1)
                gl.store(cnt_ptr + rows64 * n_tiles + tile, count, mask=rows < M)
            elif EPI == 2:  # each row's count of positive entries, to the tile's first column
                cnt = gl.sum((acc > 0.0).to(gl.int32), axis=1).to(gl.bfloat16)
                gl.store(c_ptr + rows * N + off_n, cnt, mask=rows < M)
            else:  # EPI == 0: only the tile's first column (the MMAs must still run)
                keep = (cols[None, :] < N) & ((EPI != 0) | (cols[None, :] == off_n))
                gl.store(ptrs, out, mask=(rows[:, None] < M) & keep)
        n += 1


@gluon.jit
def _load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, c_ptr, pk_ptr, cnt_ptr, M, N, K, EPI, RINGS, PARITY):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    pid, nprog, num_tiles, ksteps = _schedule(M, N, K, BM, BN, BK)
    n = 0
    for t in range(pid, num_tiles, nprog):
        off_m, off_n = _tile_coords(t, M, N, BM, BN, GROUP)
        for kk in range(ksteps):
            slot, phase = _slot(n, kk, ksteps, RINGS, STAGES)
            mbarrier.wait(empty.index(slot), phase ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BK], bar, a_bufs.index(slot))
            tma.async_copy_global_to_shared(b_desc, [off_n, kk * BK], bar, b_bufs.index(slot))
        n += 1


@gluon.jit
def gemm_kernel(a_desc, b_desc, c_ptr, pk_ptr, cnt_ptr, M, N, K, EPI, RINGS, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                num_warps: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, turn, c_ptr, pk_ptr, cnt_ptr, M, N, K, EPI, RINGS)
    zero = M - M  # a partition's arguments must be IR values, not Python ints
    if CONSUMERS == 2:  # ping-pong: even and odd tiles
        gl.warp_specialize([
            (_load, args + (zero, )),  # the default partition: its 4 warps issue the TMA loads
            (_consume, args + (zero, )),
            (_consume, args + (zero + 1, )),
        ], [4, 4], [232, 232])
    else:  # one consumer takes every tile (PARITY -1)
        gl.warp_specialize([(_load, args + (zero, )), (_consume, args + (zero - 1, ))], [4], [232])


def pingpong(x, w, out, epi=1, BM=128, BN=128, BK=64, STAGES=6, consumers=2, packed=None, rings=1):
    """``out = relu(x wᵀ)`` (``epi=1``; 2: each row's count of positives in its tile's first column,
    0: that column only; 3: TwELL into ``packed = (pairs, counts)``, the buffers of
    ``format.empty_packed(paired=True)``). Registers: 168 a thread at launch for 12 warps (two
    consumers), 256 for 8."""
    pairs, counts = packed if packed is not None else (out, out)
    M, K = x.shape
    N = w.shape[0]
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(x, [BM, BK], a_layout)
    b_desc = TensorDescriptor.from_tensor(w, [BN, BK], b_layout)
    grid = (torch.cuda.get_device_properties(x.device).multi_processor_count, )
    return gemm_kernel[grid](a_desc, b_desc, out, pairs, counts, M, N, K, int(epi), rings, STAGES, consumers, num_warps=4,
                             maxnreg=168 if consumers == 2 else 256)


def main() -> None:
    from triton.testing import do_bench

    from twell_compile.bench import make_problem
    from twell_compile.kernels.gate_pack import gate_pack

    m, k, n = 16384, 2048, 5632
    x, wg, _, _ = make_problem(m, k, n, 0.005, skewed=False)  # the bench's 0.5% problem
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    variants = {"ping-pong": {}, "one consumer": {"consumers": 1}, "two rings": {"rings": 2}}
    for name, kw in variants.items():
        out.zero_()
        pingpong(x, wg, out, **kw)
        err = (out.float() - torch.relu(x @ wg.T).float()).abs().max().item()
        print(f"{name}: max |out - relu(x Wᵀ)| = {err:.3e}", flush=True)
    # TwELL (epi=3) against gate_pack's: counts, and every stored slot's column and value
    pairs = torch.zeros(m, n // 128, 16, 2, dtype=torch.int32, device="cuda")
    counts = torch.zeros(m, n // 128, dtype=torch.int32, device="cuda")
    ref = gate_pack(x, wg, None, paired=True)
    stored = torch.arange(16, device="cuda") < ref.count.clamp(max=16)[..., None]
    for name, kw in variants.items():
        pairs.zero_()
        counts.zero_()
        pingpong(x, wg, out, epi=3, packed=(pairs, counts), **kw)
        val_diff = (pairs[..., 1].view(torch.float32)[stored] - ref.val[stored]).abs().max().item()
        print(f"{name}, TwELL: counts equal {torch.equal(counts, ref.count)}, columns equal "
              f"{torch.equal(pairs[..., 0][stored], ref.idx[stored])}, max |value - gate_pack's| {val_diff:.3e}, "
              f"stored pairs {int(stored.sum())}", flush=True)
    cases = {
        "cuBLAS x Wᵀ": lambda: x @ wg.T,
        "ping-pong, TwELL epilogue": lambda: pingpong(x, wg, out, epi=3, packed=(pairs, counts)),
        "one consumer, TwELL epilogue": lambda: pingpong(x, wg, out, epi=3, consumers=1, packed=(pairs, counts)),
        "two rings, TwELL epilogue": lambda: pingpong(x, wg, out, epi=3, rings=2, packed=(pairs, counts)),
        "two rings, row counts": lambda: pingpong(x, wg, out, epi=2, rings=2),
        "gate_pack (TwELL epilogue)": lambda: gate_pack(x, wg, None, paired=True),
        "ping-pong, row counts": lambda: pingpong(x, wg, out, epi=2),
        "ping-pong, relu + bf16 store": lambda: pingpong(x, wg, out, epi=1),
        "one consumer, row counts": lambda: pingpong(x, wg, out, epi=2, consumers=1),
    }
    for r in range(3):
        print(f"round {r}, ms: " + "  ".join(f"{name} {do_bench(f, warmup=25, rep=200):.4f}" for name, f in cases.items()),
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
