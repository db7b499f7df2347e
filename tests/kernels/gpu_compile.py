"""Compile every Triton kernel of ``twell_compile.kernels`` for a real GPU, on any machine.

CI has no GPU, so its tests run the kernels in the Triton interpreter, which never sees the GPU
compiler: a kernel can pass every CPU test and still fail to compile on the H200 (a global that is
not a constexpr, a type the interpreter tolerates). This script runs Triton's whole compiler
(frontend, TTGIR, LLVM, ``ptxas`` to a cubin) for a GPU target on the CPU, with the argument types
and meta-parameters the launchers use: every autotune config for bf16 gated FFNs, the first config
for fp16/fp32 and plain FFNs. Nothing is launched.

Usage (the interpreter must be off, so run it outside pytest's process)::

    python tests/kernels/gpu_compile.py --arch sm90 [--ptx-dir DIR]

Prints one line per compiled variant; exit status 1 if any fails.
"""

from __future__ import annotations

import argparse
import importlib
import os
import struct
import sys
import time
import traceback
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("gpu_compile: unset TRITON_INTERPRET (the kernels must be imported for the GPU compiler)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from twell_compile.kernels.dense_act import ROWS_PER_PROGRAM  # noqa: E402
from twell_compile.kernels.dense_rows import BR, scratch_tiles  # noqa: E402
from twell_compile.kernels.dense_rows_bwd import DENSE_WGRAD_TILES  # noqa: E402
from twell_compile.kernels.dense_rows_fwd import DENSE_TILES  # noqa: E402
from twell_compile.kernels.fired_neurons import STAMP_ROWS  # noqa: E402
from twell_compile.kernels.gate_pack import GROUP_M  # noqa: E402
from twell_compile.kernels.neuron_major import ORDER_BLOCK, RANK_TB  # noqa: E402
from twell_compile.kernels.pair_walk import overflow_threshold  # noqa: E402
from twell_compile.kernels.row_lists import LIST_BLOCKS, LIST_SUB  # noqa: E402
from twell_compile.kernels.tokens_bwd import DX_BLOCK_MAX  # noqa: E402
from twell_compile.kernels.weights import NORM_CHUNK, NORM_ROWS, TRANSPOSE_TILE  # noqa: E402
from twell_compile.kernels.wgrad import HOT_SEGMENTS  # noqa: E402

# Every Triton kernel by its label: each kernel module lists its own in ``KERNELS``. (Imported as
# modules by name: the package's ``gate_pack`` and ``sparse_ffn`` are the functions.)
KERNEL_MODULES = ("gate_pack", "sparse_ffn", "dense_rows_fwd", "dense_rows", "row_lists", "dense_act", "weights",
                  "floors", "neuron_major", "tokens_bwd", "dense_rows_bwd", "wgrad", "fired_neurons")
KERNELS = {name: kernel for module in KERNEL_MODULES
           for name, kernel in importlib.import_module(f"twell_compile.kernels.{module}").KERNELS.items()}

ARCHS = {"sm90": GPUTarget("cuda", 90, 32), "sm80": GPUTarget("cuda", 80, 32)}
TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}

# Benchmark shape: D = 2048, H = 5632 (44 TwELL tiles of 128 columns, 16 slots).
D, SLOTS, TILE_N, NT_P2 = 2048, 16, 128, 64

# Pointer arguments that are not of the FFN's dtype (the rest are).
F32 = {"val_ptr", "up_ptr", "coef_ptr", "hid_ptr", "part_ptr", "psum_ptr", "dh_ptr", "scale_ptr", "seg_part_ptr",
       "seg_sum_ptr", "l1_ptr", "bound_ptr"}
I32 = {"idx_ptr", "count_ptr", "rows_ptr", "ndense_ptr", "counts_ptr", "list_ptr", "ticket_ptr", "tickets_ptr", "blk_ptr",
       "rowcnt_ptr"}
U8 = {"whole_ptr"}
# Integer arguments that are multiples of 16 at the benchmark shape (M = 16384, D, H).
_SIXTEEN_SIZES = {"M", "D", "H", "K", "N"}


def _jit_fn(kernel):
    """The JITFunction under autotune/heuristics wrappers."""
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def _configs(kernel, full: bool, prune_kwargs=None, nargs=None):
    """The autotune configs a launch could try (pruned as the launcher's kwargs would), or one."""
    configs = list(kernel.configs)
    prune = getattr(kernel, "early_config_prune", None)
    if prune is not None and prune_kwargs is not None:
        configs = prune(configs, nargs or {}, **prune_kwargs)
    return configs if full else configs[:1]


def _name(config) -> str:
    cap = f" maxnreg={config.maxnreg}" if config.maxnreg else ""
    return " ".join(f"{k}={v}" for k, v in config.kwargs.items()) + f" w{config.num_warps} s{config.num_stages}{cap}"


def compile_kernel(kernel, target, dtype, consts: dict, types: dict | None = None, config=None, *, num_warps=4,
                   num_stages=None, hints: bool = True):
    """Compile one variant; returns the CompiledKernel. ``types`` overrides argument types by name;
    ``hints=False`` for a kernel that specializes none of its arguments (no divisibility hints)."""
    fn = _jit_fn(kernel)
    consts = dict(consts)
    opts = {"num_warps": num_warps}
    if num_stages is not None:
        opts["num_stages"] = num_stages
    if config is not None:
        consts.update(config.kwargs)
        opts.update(num_warps=config.num_warps, num_stages=config.num_stages)
        if config.maxnreg:
            opts["maxnreg"] = config.maxnreg
    types = types or {}
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in F32 else "*i32" if name in I32 else "*u8" if name in U8 else (
                "*" + TY[dtype])
        else:
            signature[name] = "i32"
    missing = [n for n in consts if n not in fn.arg_names]
    if missing:
        raise KeyError(f"{fn.__name__} has no arguments {missing}")
    # The launcher's JIT marks pointers and integers divisible by 16 (torch's allocations, the
    # benchmark shape's sizes and strides); without the hint loads compile unvectorised.
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
               if hints and (t.startswith("*") or (t == "i32" and (n.startswith("stride") or n in _SIXTEEN_SIZES)))}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=aligned)
    return triton.compile(src, target=target, options=opts)


def variants(arch: str, full: bool):
    """``(label, thunk)`` for every kernel variant to compile."""
    target = ARCHS[arch]
    hopper = target.arch >= 90
    cases = [(torch.bfloat16, True, full)] + [(dt, g, False) for dt, g in ((torch.bfloat16, False),
                                                                            (torch.float16, True),
                                                                            (torch.float32, True),
                                                                            (torch.float32, False))]
    for dtype, gated, all_configs in cases:
        tag = f"{TY[dtype]} {'gated' if gated else 'plain'}"
        sixteen = dtype != torch.float32  # also: fp32 variants compile the pair loops' D mask (EVEN_D off)
        ovf = overflow_threshold(dtype)

        # gate_pack: TMA descriptors (Hopper, 16-bit) or pointers.
        for use_tma in ([True, False] if hopper and sixteen else [False]):
            for cfg in _configs(KERNELS["gate_pack"], all_configs, dict(USE_TMA=use_tma)):
                types = {"x": f"*{TY[dtype]}", "w": f"*{TY[dtype]}"}
                if use_tma:
                    bm, bk = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_K"]
                    types = {"x": f"tensordesc<{TY[dtype]}[{bm}, {bk}]>", "w": f"tensordesc<{TY[dtype]}[{TILE_N}, {bk}]>"}
                # EVEN_N, EVEN_M: H = 5632 and M = 16384 fill their tiles (the benchmark shape's
                # kernels); the other cases compile the column and row masks of shapes that do not
                # PAIRED: slots as 8-byte pairs (the default, and inference's); training's two buffers.
                for paired in ([True, False] if all_configs or not use_tma else [True]):
                    consts = dict(HAS_BIAS=True, USE_TMA=use_tma, IEEE=not sixteen, INTERPRET=False, SLOTS=SLOTS,
                                  BLOCK_N=TILE_N, GROUP_M=GROUP_M, EVEN_K=D % cfg.kwargs["BLOCK_K"] == 0,
                                  EVEN_N=all_configs, EVEN_M=all_configs, PAIRED=paired)
                    label = f"gate_pack {tag} tma={use_tma} paired={paired} {_name(cfg)}"
                    yield label, (lambda consts=consts, types=types, cfg=cfg, dtype=dtype:
                                  compile_kernel(KERNELS["gate_pack"], target, dtype, consts, types, cfg))

        # Forward consumer and its dense rows.
        # The pair loops walk tiles by a bit set (BITS, H <= 8192) or tile by tile (larger H).
        walks = [True, False] if all_configs else [True]
        # bf16 rows are read as int32 pairs (PAIRS); other dtypes, and bf16 rows of odd length, by halves.
        pair_reads = [True, False] if dtype == torch.bfloat16 else [False]
        # The ops compute the guard in the pair loop (GUARD, MARK); the API's default takes dense rows.
        for store_up in ([True, False] if gated else [False]):
            for bits, pairs, guard in [(b, p, g) for b in walks for p in pair_reads for g in (True, False)]:
                for cfg in _configs(KERNELS["sparse_ffn"], all_configs, dict(BLOCK_D=D, PAIRS=pairs)):
                    # Inference reads paired slots (gate_pack's default); training two buffers.
                    consts = dict(GATED=gated, HAS_BU=True, HAS_BD=True, STORE_UP=store_up, STORE_L1=store_up,
                                  STORE_WHOLE=True, SLOTS=SLOTS, NT_P2=NT_P2, BLOCK_D=D, OVF=ovf, EVEN_D=sixteen,
                                  BITS=bits, PAIRS=pairs, GUARD=guard, MARK=guard, PAIRED=not store_up)
                    yield (f"sparse_ffn {tag} store_up={store_up} bits={bits} pairs={pairs} guard={guard} "
                           f"paired={not store_up} {_name(cfg)}",
                           lambda consts=consts, cfg=cfg, dtype=dtype: compile_kernel(
                               KERNELS["sparse_ffn"], target, dtype, consts, {"dense_ptr": "*i1"}, cfg))
        native = sixteen
        bh, bk, bd, warps = scratch_tiles(dtype)
        yield f"dense_hidden {tag}", (lambda dtype=dtype, gated=gated, ovf=ovf, bh=bh, bk=bk, warps=warps: compile_kernel(
            KERNELS["dense_hidden"], target, dtype,
            dict(GATED=gated, HAS_BG=gated, HAS_BU=True, NATIVE=sixteen, OVF=ovf, BR=BR, BH=bh, BK=bk), num_warps=warps))
        bm, bh2, bk2, bd2, warps2, stages2 = DENSE_TILES[dtype.itemsize]
        yield f"dense_rows {tag}", (lambda dtype=dtype, gated=gated, ovf=ovf, a=(bm, bh2, bk2, bd2, warps2, stages2):
                                    compile_kernel(KERNELS["dense_rows"], target, dtype,
                                                   dict(GATED=gated, HAS_BG=gated, HAS_BU=True, HAS_BD=True,
                                                        NATIVE=native, SPLIT=sixteen, OVF=ovf, BM=a[0], BH=a[1],
                                                        BK=a[2], BD=a[3]), num_warps=a[4], num_stages=a[5]))
        for two, split in ((False, sixteen), (gated, dtype == torch.bfloat16)):  # forward, backward
            yield f"split_product {tag} two={two} split={split}", (
                lambda dtype=dtype, two=two, split=split, bh=bh, bd=bd, warps=warps: compile_kernel(
                    KERNELS["split_product"], target, dtype,
                    dict(TWO=two, SPLIT=split, NATIVE=True, HAS_BIAS=not two, BR=BR, BH=bh, BD=bd),
                    {"bias_ptr": f"*{TY[dtype]}", "dst_ptr": f"*{TY[dtype]}"}, num_warps=warps))
        for rec in (False, True):
            yield f"dense_list record={rec}", (lambda rec=rec: compile_kernel(
                KERNELS["dense_list"], target, torch.float32, {"BLOCK": 4096, "RECORD": rec, "FLAG": 1.0},
                {"flags_ptr": "*u8", "values_ptr": "*fp64", "scratch_ptr": "*i64"}, num_warps=8))
        # The forward guard (records, marks the counts); the backward's on dout; on x and dout (the API's).
        for backward, has_b in ((False, False), (True, False), (True, True)):
            yield f"flag_rows {tag} backward={backward} b={has_b}", (lambda dtype=dtype, backward=backward, has_b=has_b: compile_kernel(
                KERNELS["flag_rows"], target, dtype,
                dict(HAS_B=has_b, HAS_COUNT=True, FLAG_OVERFLOW=True, RECORD=not backward, MARK=not backward,
                     LIST=not has_b, FLAG=1.0, SLOTS=SLOTS, NT_P2=NT_P2, BR=16, BK=256, CB=LIST_BLOCKS,
                     SUB=LIST_SUB),
                {"a_bound_ptr": "*fp32", "b_bound_ptr": "*fp32", "flags_ptr": "*u8", "values_ptr": "*fp64",
                 "scratch_ptr": "*i64"}))

        # The dense path's activation (fp64 too: float64 FFNs always take the dense path).
        for act_dtype in ([dtype, torch.float64] if dtype == torch.float32 and not gated else [dtype]):
            yield f"dense_act {TY[act_dtype]} {'gated' if gated else 'plain'}", (
                lambda act_dtype=act_dtype, gated=gated: compile_kernel(
                    KERNELS["dense_act"], target, act_dtype,
                    dict(GATED=gated, STORE_ACT=gated, COUNT=True, FLAG=0.0, L1=True,
                         FP64=act_dtype == torch.float64, SLOTS=SLOTS, TILE_N=TILE_N, BM=ROWS_PER_PROGRAM),
                    {"values_ptr": "*fp64", "scratch_ptr": "*i64", "l1_ptr": "*fp32"}))
            yield f"dense_act_backward {TY[act_dtype]} {'gated' if gated else 'plain'}", (
                lambda act_dtype=act_dtype, gated=gated: compile_kernel(
                    KERNELS["dense_act_backward"], target, act_dtype,
                    dict(GATED=gated, FP64=act_dtype == torch.float64, BLOCK=2048), {"dgate_ptr": f"*{TY[act_dtype]}"},
                    num_warps=8))

        # Weight preparation: Wdᵀ rows and the guard's bounds (wd [D, H] is contiguous along H).
        if gated:
            yield f"transpose {TY[dtype]}", (lambda dtype=dtype: compile_kernel(
                KERNELS["transpose"], target, dtype, dict(TILE=TRANSPOSE_TILE)))
        for store in (False, True):  # guard_bounds alone; weight_prep with the Wdᵀ rows (the ops')
            yield f"weight_facts {tag} store_wdt={store}", (lambda dtype=dtype, gated=gated, store=store: compile_kernel(
                KERNELS["weight_facts"], target, dtype,
                dict(stride_wd_j=1, LIMIT=torch.finfo(dtype).max, GATED=gated, HAS_BG=gated, HAS_BU=True,
                     HAS_BD=True, STORE_WDT=store, ROWS=NORM_ROWS, CHUNK=NORM_CHUNK),
                {"facts_ptr": "*i32", "fwd_ptr": "*fp32", "bwd_ptr": "*fp32"}))

        # twell bench --floors' bare gather (no wrapper: one config).
        yield f"gather_floor {TY[dtype]}", (lambda dtype=dtype: compile_kernel(
            KERNELS["gather_floor"], target, dtype, dict(BLOCK_D=D), {"row_ptr": "*i64", "cols_ptr": "*i32"}))

        # Telemetry: a sampled training call's fired neurons (float64 stamps, whatever the FFN's dtype).
        yield "stamp_fired", (lambda dtype=dtype: compile_kernel(
            KERNELS["stamp_fired"], target, dtype, dict(SLOTS=SLOTS, SLOTS_P2=SLOTS, TILE_N=TILE_N, TB=STAMP_ROWS),
            {"stamps_ptr": "*fp64", "now_ptr": "*fp64"}, hints=False))

        # Backward.
        for place in (False, True):
            yield f"rank {tag} place={place}", (lambda dtype=dtype, place=place: compile_kernel(
                KERNELS["rank"], target, dtype,
                dict(PLACE=place, SLOTS=SLOTS, SLOTS_P2=SLOTS, TILE_N=TILE_N, TB=RANK_TB),
                {"dense_ptr": "*u8", "tokens_ptr": "*i64", "incl_ptr": "*i32"}))
        n_chunks = -(-5632 // ORDER_BLOCK)
        block = triton.next_power_of_2(-(-5632 // n_chunks))
        yield f"order {tag}", (lambda dtype=dtype, block=block: compile_kernel(
            KERNELS["order"], target, dtype, dict(BLOCK=block), {"incl_ptr": "*i32", "ptr_ptr": "*i64", "order_ptr": "*i32"},
            num_warps=max(1, min(4, block // 256))))
        block_dx = min(D, DX_BLOCK_MAX)
        for name, kernel, block in (("tokens_dh", KERNELS["tokens_dh"], D), ("tokens_dx", KERNELS["tokens_dx"], block_dx)):
            for cfg in _configs(kernel, all_configs, dict(BLOCK_D=block)):
                for bits, pairs in [(b, p) for b in walks for p in pair_reads]:
                    yield f"{name} {tag} bits={bits} pairs={pairs} {_name(cfg)}", (
                        lambda dtype=dtype, gated=gated, cfg=cfg, bits=bits, pairs=pairs, kernel=kernel, block=block, ovf=ovf:
                        compile_kernel(kernel, target, dtype,
                                       dict(GATED=gated, SLOTS=SLOTS, BLOCK_D=block, EVEN_D=sixteen, NT_P2=NT_P2,
                                            BITS=bits, PAIRS=pairs, OVF=ovf),
                                       {"dense_ptr": "*u8"}, cfg))
        bh, bk, bd, _ = scratch_tiles(dtype)  # the backward's dense rows: the forward's scratch tiles
        flags = dict(GATED=gated, HAS_BG=gated, HAS_BU=True, NATIVE=native, BR=BR, BH=bh, BK=bk)
        yield f"dense_coef_dx {tag}", (lambda dtype=dtype, flags=flags, bd=bd: compile_kernel(
            KERNELS["dense_coef_dx"], target, dtype, dict(flags, BD=bd)))
        bj, bd_w, warps_w = DENSE_WGRAD_TILES
        yield f"dense_wgrad {tag}", (lambda dtype=dtype, gated=gated: compile_kernel(
            KERNELS["dense_wgrad"], target, dtype,
            dict(GATED=gated, SPLIT=dtype == torch.bfloat16, NATIVE=native, BR=BR, BJ=bj, BD=bd_w),
            num_warps=warps_w))
        for partial, pairs in [(p, q) for p in (False, True) for q in pair_reads]:
            for cfg in _configs(KERNELS["wgrad"], all_configs, {}, {"D": D}):
                yield f"wgrad {tag} partial={partial} pairs={pairs} {_name(cfg)}", (
                    lambda dtype=dtype, gated=gated, cfg=cfg, partial=partial, pairs=pairs, ovf=ovf: compile_kernel(
                        KERNELS["wgrad"], target, dtype,
                        dict(GATED=gated, HAS_BG=gated, HAS_BU=True, PARTIAL=partial, SEGS=HOT_SEGMENTS, BK=64,
                             EVEN_D=sixteen, PAIRS=pairs, OVF=ovf),
                        {"nptr_ptr": "*i64", "order_ptr": "*i64"}, cfg))


def registers(cubin: bytes) -> int:
    """Registers per thread of a one-kernel cubin: the ``EIATTR_REGCOUNT`` record (0x2f) of its
    ``.nv.info`` section, what ``ptxas -v`` reports as "Used N registers"."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)  # ELF64 header: section table offset
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    for name_at, _, _, _, offset, size, *_ in sections:
        if cubin[names + name_at:cubin.index(b"\0", names + name_at)] != b".nv.info":
            continue
        at = offset
        while at < offset + size:  # records: format byte, attribute byte, then a value or a sized blob
            fmt, attr = cubin[at], cubin[at + 1]
            if fmt != 4:  # fixed 2-byte value
                at += 4
                continue
            length, = struct.unpack_from("<H", cubin, at + 2)
            if attr == 0x2F:
                return struct.unpack_from("<II", cubin, at + 4)[1]  # (kernel symbol, registers)
            at += 4 + length
    raise ValueError("no EIATTR_REGCOUNT record in the cubin")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="sm90")
    parser.add_argument("--first-config-only", action="store_true", help="one autotune config per kernel and dtype")
    parser.add_argument("--ptx-dir", type=Path, help="write each variant's PTX here")
    args = parser.parse_args(argv)
    failed = 0
    t0 = time.time()
    seen = set()
    for label, thunk in variants(args.arch, full=not args.first_config_only):
        if label in seen:  # e.g. the forward's and a plain backward's split_product are one kernel
            continue
        seen.add(label)
        try:
            compiled = thunk()
        except Exception:  # report every failing variant, not just the first
            failed += 1
            print(f"FAIL {args.arch} {label}\n{traceback.format_exc()}", flush=True)
            continue
        ptx = compiled.asm["ptx"]
        wgmma = "wgmma.mma_async" in ptx
        cubin = compiled.asm["cubin"]
        print(f"ok   {args.arch} {label}  cubin {len(cubin)} B  wgmma={wgmma}  regs={registers(cubin)}", flush=True)
        if args.ptx_dir:
            args.ptx_dir.mkdir(parents=True, exist_ok=True)
            (args.ptx_dir / (label.replace(" ", "_").replace("/", "-")[:150] + ".ptx")).write_text(ptx)
    print(f"{'FAILED' if failed else 'passed'}: {failed} failures, {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
