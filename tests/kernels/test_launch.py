"""kernels/launch.py: ``launch(kernel, grid, ...)`` is ``kernel[grid](...)`` with less host work.

Everywhere: the results equal the plain launch's. On the GPU (the lean path runs only there): the
binary launched is the one Triton picks for the same arguments (one per specialization, e.g.
pointer alignment), an autotuned kernel runs the config its autotuner chose, with its pre-hook and
heuristics, and launch hooks (profilers) still see every launch.
"""

from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from twell_compile.kernels.triton_helpers import INTERPRET  # noqa: E402

L = importlib.import_module("twell_compile.kernels.launch")  # the module itself: tests patch its state

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) + tl.load(y_ptr + i, mask=i < n), mask=i < n)


_PRE_HOOK_CALLS = []


def _count_pre_hook(nargs):
    _PRE_HOOK_CALLS.append(nargs["n"])


# the interpreter cannot autotune over several configs (it has no GPU driver to time them)
_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, pre_hook=_count_pre_hook) for b, w in ((32, 1), (64, 2))]


@triton.autotune(configs=_CONFIGS[:1] if INTERPRET else _CONFIGS, key=["n"])
@triton.heuristics({"EVEN": lambda a: a["n"] % a["BLOCK"] == 0})
@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:  # no mask: wrong for a tail, so a wrong EVEN shows in the result
        tl.store(out_ptr + i, tl.load(x_ptr + i) * scale)
    else:
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * scale, mask=i < n)


def _scale_key(*args, **kwargs):
    """``launch``'s tuning key of ``_scale_kernel`` for these arguments."""
    named = dict(zip(_scale_kernel.arg_names, args))
    named.update(kwargs)
    return L.tuning_key(_scale_kernel, named)


def test_tuning_key_follows_the_autotuners_key():
    """The key arguments' values and the kernel arguments' dtypes, as ``Autotuner.run`` keys its
    choice; launch options such as ``num_warps`` are not kernel arguments."""
    x32, x16 = torch.zeros(4), torch.zeros(4, dtype=torch.float16)
    assert _scale_key(x32, x32, 8, 1.0) == _scale_key(x32, x32, 8, 2.0)
    assert _scale_key(x32, x32, 8, 1.0) != _scale_key(x32, x32, 16, 1.0)
    assert _scale_key(x32, x32, 8, 1.0) != _scale_key(x16, x32, 8, 1.0)
    assert _scale_key(x32, x32, 8, 1.0) == _scale_key(x32, x32, 8, 1.0, num_warps=4)


def _add(x, y, n, block=64):
    out = torch.full_like(x, -1.0)
    L.launch(_add_kernel, (triton.cdiv(n, block),), x, y, out, n, BLOCK=block)
    return out


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 300), offset=st.integers(0, 9), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_launch_computes_what_the_plain_launch_computes(n, offset, dtype):
    base = torch.randn(n + offset, device=DEV).to(dtype)
    x, y = base[offset:], torch.randn(n, device=DEV).to(dtype)
    out = _add(x, y, n)
    plain = torch.full_like(x, -1.0)
    _add_kernel[(triton.cdiv(n, 64),)](x, y, plain, n, BLOCK=64)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    torch.testing.assert_close(out, x + y, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 31, 32, 64, 100, 256])
def test_autotuned_kernel_with_heuristics(n):
    x = torch.randn(n, device=DEV)
    for scale in (2.0, -0.5):  # the first call tunes, the next ones take the remembered config
        out = torch.zeros_like(x)
        L.launch(_scale_kernel, lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x, out, n, scale)
        torch.testing.assert_close(out, x * scale, rtol=0, atol=0)


@gpu
def test_each_specialization_launches_tritons_own_binary():
    n = 200
    x, y = torch.randn(n + 1, device="cuda"), torch.randn(n, device="cuda")
    seen = []
    for xs in (x[:n], x[1:]):  # 16-byte aligned, then not: two specializations
        out = _add(xs, y, n)
        out = _add(xs, y, n)  # the second call takes the lean path
        torch.testing.assert_close(out, xs + y, rtol=0, atol=0)
        plain = _add_kernel[(triton.cdiv(n, 64),)](xs, y, torch.empty_like(y), n, BLOCK=64)
        seen.append(plain)
        assert L.compiled_kernels[_key(_add_kernel, xs, y, out, n, BLOCK=64)] is plain
    assert seen[0] is not seen[1]


@gpu
def test_autotuned_launch_uses_the_tuners_choice_and_runs_its_pre_hook():
    n = 96  # EVEN for BLOCK 32, not for 64
    x = torch.randn(n, device="cuda")
    out = torch.zeros_like(x)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
    L.launch(_scale_kernel, grid, x, out, n, 3.0)
    chosen = L.chosen_configs[(id(_scale_kernel), _scale_key(x, out, n, 3.0))]
    assert chosen is _scale_kernel.best_config
    before = len(_PRE_HOOK_CALLS)
    L.launch(_scale_kernel, grid, x, out, n, 4.0)
    assert _PRE_HOOK_CALLS[before:] == [n]
    torch.testing.assert_close(out, x * 4.0, rtol=0, atol=0)
    even = n % chosen.kwargs["BLOCK"] == 0
    assert _key(_scale_kernel.fn.fn, x, out, n, 4.0, **chosen.all_kwargs(), EVEN=even) in L.compiled_kernels


def test_tuned_configs_name_each_kernel_its_key_and_the_choice(monkeypatch):
    """One line per (kernel, tuning key): the key's arguments by name, then the dtypes."""
    config = triton.Config({"BLOCK": 64}, num_warps=2)
    monkeypatch.setattr(L, "chosen_configs", {(1, (96, torch.float32, torch.float32)): config})
    monkeypatch.setattr(L, "tuner_names", {1: ("_scale_kernel", ("n",))})
    assert L.tuned_configs() == [("_scale_kernel", "n=96 torch.float32 torch.float32", str(config))]


@gpu
def test_tuned_configs_list_the_autotuners_choice():
    n = 80
    x = torch.randn(n, device="cuda")
    out = torch.zeros_like(x)
    L.launch(_scale_kernel, lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x, out, n, 2.0)
    chosen = L.chosen_configs[(id(_scale_kernel), _scale_key(x, out, n, 2.0))]
    assert ("_scale_kernel", "n=80 torch.float32 torch.float32", str(chosen)) in L.tuned_configs()


@gpu
def test_launch_hooks_see_lean_launches():
    from triton import knobs

    names = []
    hook = lambda metadata: names.append(metadata.get()["name"])  # noqa: E731
    n = 64
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    _add(x, y, n)  # compiled (and remembered) before the hook is added
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out = _add(x, y, n)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert names == ["_add_kernel"]
    torch.testing.assert_close(out, x + y, rtol=0, atol=0)


def test_plain_switch_sends_launches_through_triton(monkeypatch):
    monkeypatch.setattr(L, "PLAIN", True)
    monkeypatch.setattr(L, "compiled_kernels", {})
    n = 40
    x, y = torch.randn(n, device=DEV), torch.randn(n, device=DEV)
    torch.testing.assert_close(_add(x, y, n), x + y, rtol=0, atol=0)
    assert L.compiled_kernels == {}


def _key(fn, *args, **kwargs):
    device = torch.cuda.current_device()
    _, specialization, options = fn.device_caches[device][4](*args, **kwargs)
    return (id(fn), device, tuple(specialization), tuple(options.items()))


@given(a=st.integers(0, 10**6), b=st.integers(1, 5000))
def test_host_grid_helpers_match_triton(a, b):
    assert L.cdiv(a, b) == triton.cdiv(a, b)
    assert L.next_power_of_2(a) == triton.next_power_of_2(a)


@gpu
def test_a_capture_never_autotunes_it_runs_an_untuned_config_once():
    n = 1000  # a tuning key no other test uses
    x = torch.randn(n, device="cuda")
    out = torch.zeros_like(x)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
    key = (id(_scale_kernel), _scale_key(x, out, n, 5.0))
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(RuntimeWarning, match="never tuned"):
        with torch.cuda.graph(graph):
            L.launch(_scale_kernel, grid, x, out, n, 5.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 5.0, rtol=0, atol=0)
    assert key not in L.chosen_configs  # the next call outside the capture tunes
    L.launch(_scale_kernel, grid, x, out, n, 6.0)
    assert L.chosen_configs[key] is _scale_kernel.best_config
    torch.testing.assert_close(out, x * 6.0, rtol=0, atol=0)


def test_the_untuned_config_is_the_first_one_pruning_keeps():
    """What a capture runs for a key never tuned (host logic only: no launch, no GPU)."""
    configs = [triton.Config({"BLOCK": b}) for b in (16, 32, 64)]
    seen = {}

    def drop_small(configs, nargs, **kwargs):
        seen.update(nargs)
        return [c for c in configs if c.kwargs["BLOCK"] >= nargs["n"]]

    tuner = triton.autotune(configs=configs, key=["n"], prune_configs_by={"early_config_prune": drop_small})(_add_kernel)
    x = torch.zeros(4)
    with pytest.warns(RuntimeWarning, match="never tuned"):
        config = L.untuned_config(tuner, (x, x, x, 20), {})
    assert config is configs[1]
    assert seen["n"] == 20 and tuner.nargs is None


@gpu
def test_first_launches_counts_the_launches_that_compile_or_tune(monkeypatch):
    """What the graph variants' step-time measurement checks: a launch that goes through Triton's
    own path (a binary or tuning key not seen here) counts, a repeated one never does."""
    monkeypatch.setattr(L, "compiled_kernels", {})
    monkeypatch.setattr(L, "chosen_configs", {})
    n = 96
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.zeros_like(x)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
    start = L.first_launches()
    _add(x, y, n)
    assert L.first_launches() == start + 1
    _add(x, y, n)
    assert L.first_launches() == start + 1
    L.launch(_scale_kernel, grid, x, out, n, 2.0)  # tunes
    tuned = L.first_launches()
    assert tuned > start + 1
    for scale in (3.0, 4.0, 5.0):
        L.launch(_scale_kernel, grid, x, out, n, scale)
    settled = L.first_launches()
    L.launch(_scale_kernel, grid, x, out, n, 6.0)
    _add(x, y, n)
    assert L.first_launches() == settled
    torch.testing.assert_close(out, x * 6.0, rtol=0, atol=0)
