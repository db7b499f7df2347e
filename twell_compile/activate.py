"""``TWELL=1``: switch the rewrite on for scripts that are not modified (docs/architecture.md, 'TWELL=1').

``activate_from_env`` is called by the ``torch.backends`` autoload hook at the end of
``import torch``. It reads the ``TWELL_*`` options (an invalid value stops the run with a message
naming the variable) and installs three routes, so every way a script runs its model is covered:

1. Eager patch: a global module pre-hook patches the FFN modules of the first model called
   (``patch_ffn.patch``), then removes itself. This covers scripts that never compile, DDP (one
   op per FFN, so DDPOptimizer's bucket splits cannot cut an FFN) and compiled models whose FFNs
   are modules (the patched op is captured as is).
2. Inductor: the same graph rewrite as Inductor's ``pre_grad_custom_pass``, for FFNs written
   inline in a larger forward. Any compile that uses Inductor gets it (default ``torch.compile``,
   ``backend="inductor"``, HF ``torch_compile=True``, accelerate's INDUCTOR, Lightning), so it does
   not depend on the backend name, which accelerate would reject.
3. On torch builds that have ``torch.compiler.set_default_backend``, a bare ``torch.compile``
   uses ``backend="twell"`` itself.

Routes 2 and 3 are installed lazily, at the first ``torch.compile`` call, so ``import torch``
never imports Inductor.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
import weakref
from typing import Optional

import torch

from .options import TwellOptions

_lock = threading.Lock()
_options: Optional[TwellOptions] = None
_hook_handle = None
_compile_routes_installed = False


def activate_from_env() -> None:
    """Read ``TWELL_*`` and install the routes; an invalid value exits with a clear message."""
    try:
        options = TwellOptions.from_env()
        if "TWELL_QUIET" in os.environ:
            from .options import env_flag

            env_flag("TWELL_QUIET")  # a bad value stops the run here, like the other variables
    except ValueError as exc:
        sys.stderr.write(f"{exc}\n")
        raise SystemExit(2) from None
    install(options)


def install(options: TwellOptions) -> None:
    """Install the eager-patch hook and the lazy compile routes (idempotent)."""
    global _options, _hook_handle
    with _lock:
        if _options is not None:
            return
        _options = options
        from . import loss_scaling_hooks

        loss_scaling_hooks.install()
        _hook_handle = torch.nn.modules.module.register_module_forward_pre_hook(_patch_on_first_call)
        torch.compile = _compile_wrapper(torch.compile)


# Modules already examined (with their submodules): each root is patched once.
_seen: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_roots_without_ffn = 0
_MAX_ROOTS_WITHOUT_FFN = 16


def active_options() -> Optional[TwellOptions]:
    """The ``TWELL_*`` options if ``TWELL=1`` activated twell in this process, else None."""
    return _options


def _patch_on_first_call(module, args):
    if module not in _seen and not torch.compiler.is_compiling():
        _patch_now(module)
        from .patch_ffn import STATE_ATTR

        if STATE_ATTR in module.__dict__:
            # The module being called is itself an FFN that was just patched, but its call has
            # already looked up the old forward: compute this one call again, patched.
            _rerun_patched(module, args)
    return None


def patch_options(options: TwellOptions) -> dict:
    """The options ``patch()`` takes, from the backend's."""
    return dict(l1_coeff=options.l1_coeff, strict=options.strict, relu_gate=options.relu_gate,
                target_density=options.target_density, l1_coeff_max=options.l1_coeff_max)


def _rerun_patched(module, args) -> None:
    def rerun(mod, call_args, output):
        handle.remove()
        return mod(*call_args)

    handle = module.register_forward_hook(rerun)


def _patch_now(module) -> None:
    global _roots_without_ffn
    from .patch_ffn import patch

    _seen.update(module.modules())
    result = patch(module, **patch_options(_options))
    if result.rewritten:
        announce(result.rewritten, result.skipped)
        from .integrations import attach_to_running_trainer

        attach_to_running_trainer()  # a Hugging Face Trainer's accumulation steps and logs
        _remove_hook()  # global hooks slow every module call; the model is patched now
    else:
        if result.skipped or _looks_like_a_model(module):
            _warn_nothing_matched(module, result.skipped)
        _roots_without_ffn += 1
        if _roots_without_ffn >= _MAX_ROOTS_WITHOUT_FFN:
            _remove_hook()  # no FFN modules here; the compile route still covers inline FFNs


_announced = False
_warned_roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def quiet() -> bool:
    """``TWELL_QUIET=1`` silences the one-line summary and the nothing-matched warning."""
    from .options import env_flag

    try:
        return env_flag("TWELL_QUIET")
    except ValueError:
        return False  # checked at activation, which stops the run on a bad value


def announce(rewritten, skipped) -> None:
    """One line on stderr, at the first rewrite: what ``TWELL=1`` did (unless ``TWELL_QUIET=1``)."""
    global _announced
    if _announced or not rewritten or quiet():
        return
    _announced = True
    from .reporting import name_pattern

    names = name_pattern([r.where for r in rewritten])
    sys.stderr.write(f"twell: rewrote {len(rewritten)} FFN(s) ({names}), skipped {len(skipped)}; "
                     f"l1_coeff {_options.l1_coeff:g} (twell_compile.report() has the details; TWELL_QUIET=1 silences this)\n")


def _looks_like_a_model(module) -> bool:
    return sum(isinstance(m, torch.nn.Linear) for m in module.modules()) >= 2


def _warn_nothing_matched(module, skipped) -> None:
    if quiet() or skipped:
        return  # patch() itself warned about the FFN-like patterns it found
    if module in _warned_roots:
        return
    _warned_roots.add(module)
    warnings.warn(f"twell: TWELL=1 patched no FFN of {type(module).__name__} (it has no ReLU FFN module). FFNs written "
                  "inline are still rewritten if the model is compiled; twell_compile.report() lists what was found.",
                  RuntimeWarning, stacklevel=3)


def _remove_hook() -> None:
    global _hook_handle
    if _hook_handle is not None:
        _hook_handle.remove()
        _hook_handle = None


def _compile_wrapper(compile_fn):
    if getattr(compile_fn, "_twell_wrapped", False):
        return compile_fn

    @functools.wraps(compile_fn)
    def compile(*args, **kwargs):  # forwards everything untouched: kwargs differ across torch versions
        install_compile_routes()
        if args and isinstance(args[0], torch.nn.Module):
            _patch_now(args[0])  # before compiling, so DDP graph splits cannot cut an FFN
            _remove_hook()  # torch warns about global hooks on compiled modules; compile covers the rest
        return compile_fn(*args, **kwargs)

    compile._twell_wrapped = True
    return compile


def install_compile_routes() -> None:
    """Route 2 (Inductor pre-grad pass) and route 3 (default backend), once."""
    global _compile_routes_installed
    with _lock:
        if _compile_routes_installed:
            return
        _compile_routes_installed = True
    from torch._inductor import config

    from .pre_grad import TwellPreGradPass

    existing = config.pre_grad_custom_pass
    if isinstance(existing, (list, tuple)):
        config.pre_grad_custom_pass = [*existing, TwellPreGradPass(_options)]
    else:
        config.pre_grad_custom_pass = TwellPreGradPass(_options, inner=existing)
    if hasattr(config, "pre_grad_pass_timing"):
        # torch >= 2.13 runs uuid-carrying pre-grad passes "late", after the parameters are lifted;
        # the rewrite registers a buffer (the L1 coefficient), so it must run before that.
        config.pre_grad_pass_timing = "early"
    set_default = getattr(torch.compiler, "set_default_backend", None)
    if set_default is not None:
        set_default("twell")
