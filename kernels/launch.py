"""``launch(kernel, grid, *args, **kwargs)``: ``kernel[grid](*args, **kwargs)`` with less host work.

A sparse training step launches 21 Triton kernels, and on the H200's hosts Triton 3.6 spends
38–64 µs in ``JITFunction.run`` per launch (80–180 µs through an autotuner): 1.2–1.6 ms of host
time per step, which makes the step host-bound (docs/benchmarks.md). Much of that is
work whose result does not change between calls of one launch site: turning the options into a
cache key string, building the launch hooks' metadata and calling two empty hook chains, and,
through ``triton.autotune`` and ``triton.heuristics``, rebuilding keys and argument dicts.

Here a kernel already compiled for a call's exact specialization is launched directly:

* the specialization is still Triton's own, from the kernel's binder (dtypes, 16-byte alignment of
  every pointer, divisibility of every integer, constexpr values, tensor-descriptor block shapes),
  so a call gets exactly the binary ``kernel[grid]`` would pick;
* the first call of each specialization, and of each autotuning key, goes through Triton
  unchanged (compiling and autotuning there), and its result is remembered;
* launch hooks (profilers) still run when any are registered;
* what remains per call is Triton's binder, the grid and the compiled launcher: 15–27 µs on
  the H200's hosts, plus, for an autotuned kernel, one dict of the arguments by
  name that the tuning key, the config's pre-hook and the heuristics all read;
* while a CUDA graph is captured, a tuning key never seen runs the kernel's first config that
  passes its pruning (with a warning) instead of timing configs, which would break the capture;
* anything this module does not recognise (the interpreter, another Triton version's internals)
  falls back to ``kernel[grid](...)``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional, Union

import torch

from .triton_helpers import INTERPRET

# TWELL_PLAIN_LAUNCH=1 sends every launch through ``kernel[grid](...)``: the escape hatch, and the
# A/B baseline of the benchmarks.
_plain = os.environ.get("TWELL_PLAIN_LAUNCH", "0")
if _plain not in ("0", "1"):
    raise ValueError(f"TWELL_PLAIN_LAUNCH must be 0 or 1, got {_plain!r}")
PLAIN = _plain == "1"

try:  # the Triton internals this module relies on (checked once; else: plain launches)
    from triton import knobs
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    _SUPPORTED = all(hasattr(JITFunction, a) for a in ("run", "create_binder")) and hasattr(
        knobs.runtime, "launch_enter_hook")
except ImportError:  # pragma: no cover - other Triton versions
    _SUPPORTED = False

raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)
# torch.cuda.current_device() without its lazy-init check: a launch only happens once CUDA is up
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device

Grid = Union[tuple, Callable[[dict], tuple]]

# (id(kernel), device, specialization, options) -> CompiledKernel (kernels live as long as their
# modules; id() keeps JITFunction.__hash__, which hashes the source key, off the hot path)
compiled_kernels: dict = {}
# (id(autotuner), tuning key) -> the Config it chose
chosen_configs: dict = {}


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton 3.6's is a constexpr function, whose argument
    unwrapping costs ~2 µs per call from Python (a training step computes ~40 grid sizes)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (0 for 0), without the constexpr-call overhead."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def launch(kernel: Any, grid: Grid, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` for a ``triton.jit`` kernel, optionally wrapped in
    ``triton.heuristics`` and one ``triton.autotune``: the same binary, config and results, with
    less host time per call."""
    layers = None if (PLAIN or INTERPRET or not _SUPPORTED) else _layers(kernel)
    if layers is None:
        kernel[grid](*args, **kwargs)
        return
    tuner, heuristics, fn = layers
    if tuner is None and not heuristics:
        _launch_jit(fn, grid, args, kwargs)
        return
    # One dict of the arguments by name serves the tuning key, the pre-hook and every heuristic
    # (Triton rebuilds it for each, which made an autotuned launch cost ~55 µs of host time
    # against 15-27 µs for a plain one on the H200's hosts).
    named = dict(zip(fn.arg_names, args))
    named.update(kwargs)
    if tuner is not None:
        key = (id(tuner), tuning_key(tuner, named))
        config = chosen_configs.get(key)
        if config is None and capturing():
            config = untuned_config(tuner, args, kwargs)
        elif config is None:  # Triton tunes (or finds the tuned config) and launches
            _count_first_launch()
            kernel[grid](*args, **kwargs)
            chosen_configs[key] = tuner.best_config
            return
        extra = _config_kwargs(config)
        kwargs = {**kwargs, **extra}
        named.update(extra)
        if config.pre_hook is not None:
            config.pre_hook(dict(named))
    for h in heuristics:  # as Heuristics.run: each value sees the ones set before it
        kwargs = dict(kwargs)
        for name, rule in h.values.items():
            kwargs[name] = named[name] = rule(named)
    _launch_jit(fn, grid, args, kwargs)


def capturing(device: Optional[torch.device] = None) -> bool:
    """Whether a CUDA graph is being captured on the current stream (False for a non-CUDA
    ``device``)."""
    return (device is None or device.type == "cuda") and torch.cuda.is_current_stream_capturing()


def untuned_config(tuner: "Autotuner", args: tuple, kwargs: dict):
    """The config to launch with while a CUDA graph is captured and this key was never tuned:
    timing configs would synchronise, which a capture forbids. The first config that passes the
    kernel's pruning: any config computes the same result; this one may be slower. Not
    remembered, so the next call outside capture tunes."""
    tuner.nargs = dict(zip(tuner.arg_names, args))
    try:
        config = tuner.prune_configs(kwargs)[0]
    finally:
        tuner.nargs = None
    warnings.warn(f"twell: {tuner.base_fn.__name__} was never tuned for these arguments and a CUDA graph is "
                  f"being captured, so it runs an untuned config ({config}) in this graph. Run the layer "
                  f"once outside the capture to tune it first.", RuntimeWarning, stacklevel=3)
    return config


_layer_cache: dict = {}


def _layers(kernel: Any):
    """``(autotuner or None, [heuristics, outermost first], jit function)``, or None for anything
    else (then the launch is Triton's own)."""
    hit = _layer_cache.get(id(kernel))
    if hit is not None:
        return hit[1]
    tuner, heuristics, inner = None, [], kernel
    if isinstance(inner, Autotuner):
        tuner, inner = inner, inner.fn
    while isinstance(inner, Heuristics):
        heuristics.append(inner)
        inner = inner.fn
    layers = (tuner, heuristics, inner) if isinstance(inner, JITFunction) else None
    _layer_cache[id(kernel)] = (kernel, layers)  # the kernel is kept alive, so its id stays its own
    if layers is not None and tuner is not None:
        tuner_names[id(tuner)] = (inner.__name__, tuple(tuner.keys))
    return layers


# id(autotuner) -> (its kernel's name, its key's argument names), for tuned_configs
tuner_names: dict = {}
# Launches that went through Triton's own path for a binary or tuning key not seen before
# (compiling or autotuning there), for first_launches.
_first_launches = 0


def first_launches() -> int:
    """How many launches so far were the first of their binary or tuning key here, so that Triton
    compiled or autotuned in them: a timing taken while this count moved measured that work too.
    (With ``TWELL_PLAIN_LAUNCH=1`` or the interpreter no launch is remembered, and it stays 0.)"""
    return _first_launches


def tuned_configs() -> list[tuple[str, str, str]]:
    """``(kernel, key, config)`` for every config Triton's autotuner chose for a kernel launched
    here, in the order they were first tuned. The autotuner keys its choice on shapes and dtypes,
    not on the data, so the first call of a key picks the config every later call with that key
    runs, whatever its density or neuron skew."""
    out = []
    for (tuner_id, key), config in chosen_configs.items():
        name, names = tuner_names.get(tuner_id, ("?", ()))
        shown = [f"{n}={v}" for n, v in zip(names, key)] + [str(v) for v in key[len(names):]]
        out.append((name, " ".join(shown), str(config)))
    return out


def _launch_jit(fn: "JITFunction", grid: Grid, args: tuple, kwargs: dict) -> None:
    device = _current_device()
    binder = fn.device_caches[device][4]
    bound, specialization, options = binder(*args, **kwargs)
    key = (id(fn), device, tuple(specialization), tuple(options.items()))
    compiled = compiled_kernels.get(key)
    if compiled is None:  # Triton compiles (or finds on disk) and launches it
        _count_first_launch()
        compiled = fn.run(*args, grid=grid, warmup=False, **kwargs)
        if hasattr(compiled, "result"):  # asynchronous compilation
            compiled = compiled.result()
        if compiled is not None:
            compiled_kernels[key] = compiled
        return
    if callable(grid):
        grid = grid(bound)
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = raw_stream(device)
    values = bound.values()
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _listening(enter) or _listening(leave):  # a profiler: give it what Triton gives it
        metadata = compiled.launch_metadata(grid, stream, *values)
    else:
        metadata = enter = leave = None
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave, *values)


def _count_first_launch() -> None:
    global _first_launches
    _first_launches += 1


def _listening(hook) -> bool:
    """Whether a launch hook would do anything (Triton 3.6 passes empty hook chains to every
    launch, which its launcher then calls)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def tuning_key(tuner: "Autotuner", named: dict) -> tuple:
    """What ``Autotuner.run`` keys its choice on, from the call's arguments by name: the values of
    its ``key`` arguments and the dtype of every kernel argument that has one."""
    params = _param_names.get(id(tuner))
    if params is None:
        params = _param_names[id(tuner)] = frozenset(tuner.arg_names)
    key = [named[k] for k in tuner.keys if k in named]
    key += [v.dtype for k, v in named.items() if k in params and hasattr(v, "dtype")]
    return tuple(key)


# id(autotuner) -> its kernel's parameter names (autotuners live as long as their modules)
_param_names: dict = {}
# id(config) -> (config, its launch keyword arguments): configs live in their autotuners
_config_extra: dict = {}


def _config_kwargs(config) -> dict:
    """``config.all_kwargs()``, built once per config."""
    hit = _config_extra.get(id(config))
    if hit is None or hit[0] is not config:
        hit = _config_extra[id(config)] = (config, config.all_kwargs())
    return hit[1]
