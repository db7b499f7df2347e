"""``TWELL=1``: switch the rewrite on for scripts that are not modified (docs/architecture.md, 'TWELL=1').

``activate_from_env`` is called by the ``torch.backends`` autoload hook at the end of
``import torch``. It reads the ``TWELL_*`` variables (an invalid value or an unknown name stops
the run with a message naming the variable) and installs three routes, so every way a script runs
its model is covered:

1. Eager patch: a global module pre-hook patches the FFN modules of each model called
   (``patch_ffn.patch``) until it has patched one called in training mode with grad enabled (a
   frozen teacher or an evaluation may run first), then removes itself. This covers scripts that
   never compile, DDP (one op per FFN, so DDPOptimizer's bucket splits cannot cut an FFN) and
   compiled models whose FFNs are modules (the patched op is captured as is).
2. Inductor: the same graph rewrite as Inductor's ``pre_grad_custom_pass``, for FFNs written
   inline in a larger forward. Any compile that uses Inductor gets it (default ``torch.compile``,
   ``backend="inductor"``, HF ``torch_compile=True``, accelerate's INDUCTOR, Lightning), so it does
   not depend on the backend name, which accelerate would reject.
3. On torch builds that have ``torch.compiler.set_default_backend``, a bare ``torch.compile``
   uses ``backend="twell"`` itself.

Routes 2 and 3 are installed lazily, at the first ``torch.compile`` call, so ``import torch``
never imports Inductor. That call also patches the module it is handed, which may be one decoder
block (accelerate's regional compilation): the layers are registered on the compiled module's
first call, under the model then calling it, so the L1 term stays a mean over the model's layers.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref
from typing import Optional

import torch

from . import announcement
from .announcement import announce
from .options import TwellOptions, quiet

_lock = threading.Lock()
_options: Optional[TwellOptions] = None
_hook_handle = None
_compile_routes_installed = False


def activate_from_env() -> None:
    """Read ``TWELL_*`` and install the routes; an invalid value exits with a clear message."""
    from .options import check_env

    try:
        options = TwellOptions.from_env()
        check_env()  # TWELL_QUIET, TWELL_PLAIN_LAUNCH, unknown names: stopped here, like the options
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
        announcement.start(options)
        from . import loss_scaling_hooks

        loss_scaling_hooks.install()
        _hook_handle = torch.nn.modules.module.register_module_forward_pre_hook(_patch_on_first_call)
        torch.compile = _compile_wrapper(torch.compile)


# Modules already examined (with their submodules): each root is patched once.
_seen: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
# Roots with patched FFNs: the hook stays until one of them is called to train.
_patched_roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_roots_without_ffn = 0
_MAX_ROOTS_WITHOUT_FFN = 16


def active_options() -> Optional[TwellOptions]:
    """The ``TWELL_*`` options if ``TWELL=1`` activated twell in this process, else None."""
    return _options


def _patch_on_first_call(module, args):
    if torch.compiler.is_compiling():
        return None
    if module not in _seen:
        from .patch_ffn import STATE_ATTR

        was_patched = STATE_ATTR in module.__dict__
        _patch_root(module)
        if STATE_ATTR in module.__dict__ and not was_patched:
            # The module being called is itself an FFN that was just patched, but its call has
            # already looked up the old forward: this call's output is the patched forward's.
            _rerun_patched(module)
    elif module in _patched_roots and _trains(module):
        _remove_hook()  # patched while frozen or evaluated; it trains now
    return None


_patch_on_first_call._twell_internal = True  # not a hook a patched FFN must fall back for


def _trains(module) -> bool:
    return module.training and torch.is_grad_enabled()


def patch_options(options: TwellOptions) -> dict:
    """The options ``patch()`` takes, from the backend's."""
    return dict(l1_coeff=options.l1_coeff, strict=options.strict, relu_gate=options.relu_gate,
                target_density=options.target_density, l1_coeff_max=options.l1_coeff_max)


def _rerun_patched(module) -> None:
    # Prepended, so the module's other forward hooks run once, on the patched output; forward, not
    # __call__, so no hook runs twice.
    def rerun(mod, call_args, call_kwargs, output):
        handle.remove()
        return mod.forward(*call_args, **call_kwargs)

    handle = module.register_forward_hook(rerun, with_kwargs=True, prepend=True)


def _patch_root(module) -> None:
    """Route 1: patch a model at its first call; its layers are registered under it."""
    global _roots_without_ffn
    from .patch_ffn import patch

    _seen.update(module.modules())
    already = _has_patched_modules(module)
    result = patch(module, **patch_options(_options))
    if result.rewritten:
        # A frozen teacher or an evaluation: say so, since the model that trains comes next.
        note = "" if _trains(module) else ("; it was called in eval mode or without grad, so the next model called is "
                                           "patched too")
        announce(result.rewritten, result.skipped, note=note)
        from .integrations import attach_to_running_trainer

        attach_to_running_trainer()  # a Hugging Face Trainer's accumulation steps and logs
    if result.rewritten or already:
        _patched_roots.add(module)
        if _trains(module):
            _remove_hook()  # global hooks slow every module call; the model that trains is patched
        return
    if not result.skipped and _looks_like_a_model(module):
        _warn_nothing_matched(module, [], compiled=False)  # with skips, patch() itself warned
    _roots_without_ffn += 1
    if _roots_without_ffn >= _MAX_ROOTS_WITHOUT_FFN:
        _remove_hook()  # no FFN modules here; the compile route still covers inline FFNs


def _has_patched_modules(module) -> bool:
    from .patch_ffn import STATE_ATTR

    return any(STATE_ATTR in m.__dict__ for m in module.modules())


def _looks_like_a_model(module) -> bool:
    """Two or more modules with a weight matrix: nn.Linear, HF's Conv1D (GPT-2), embeddings."""
    def has_matrix(m):
        weight = m._parameters.get("weight")
        return isinstance(weight, torch.Tensor) and weight.dim() == 2

    return sum(has_matrix(m) for m in module.modules()) >= 2


_warned_roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _warn_nothing_matched(module, skipped, *, compiled: bool) -> None:
    if quiet() or module in _warned_roots:
        return
    _warned_roots.add(module)
    name = type(module).__name__
    if skipped:
        from .reporting import warn_unrewritten

        warn_unrewritten(name, id(module), skipped, "TWELL=1, eager patch and compiled graphs", stacklevel=4)
        return
    if compiled:
        why = "none of its modules is a ReLU FFN of nn.Linear projections and its compiled graphs hold no FFN"
    else:
        why = ("none of its modules is a ReLU FFN of nn.Linear projections; FFNs written inline are still rewritten "
               "if the model is compiled")
    warnings.warn(f"twell: TWELL=1 rewrote no FFN of {name}: {why}. twell_compile.report() lists what was found.",
                  RuntimeWarning, stacklevel=4)


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
        if not (args and isinstance(args[0], torch.nn.Module)):
            return compile_fn(*args, **kwargs)
        _watch_compiles()
        first_call = _patch_for_compile(args[0])  # before compiling, so DDP graph splits cannot cut an FFN
        compiled = compile_fn(*args, **kwargs)
        first_call.attach(compiled)
        return compiled

    compile._twell_wrapped = True
    return compile


def _patch_for_compile(target) -> "_FirstCompiledCall":
    """The module handed to ``torch.compile`` may be the model or one block of it (accelerate's
    regional compilation): its FFN modules are patched now, their layers registered at the first
    call, under the model on the stack. No warning now: the compiled graphs may rewrite what
    patch() cannot (inline FFNs), which the first call tells."""
    from .patch_ffn import patch_modules

    _seen.update(target.modules())
    already = _has_patched_modules(target)
    result, patched = patch_modules(target, _options, register_on_call=True, warn=False)
    if target.training:
        _remove_hook()  # torch warns about global hooks on compiled modules; compile covers the rest
    check = not (patched or already) and (bool(result.skipped) or _looks_like_a_model(target))
    return _FirstCompiledCall(target, patched, result.skipped, check)


def _register_waiting(model, modules=(), skipped=()) -> None:
    """The layers patched for a compile: those of ``model`` under it, the rest of ``modules`` under
    the module compiled; said on stderr."""
    from .patch_ffn import register_waiting

    rewritten = register_waiting(model, modules)
    if rewritten:
        announce(rewritten, skipped)
        from .integrations import attach_to_running_trainer

        attach_to_running_trainer()


def _on_compile_start(*args) -> None:
    """Dynamo starts compiling a frame: the layers still waiting are registered before it traces
    them (else it would break the graph to register them). The path for a framework that compiles
    the module's methods itself (Lightning compiles ``training_step``), past the hook on what
    ``torch.compile`` returned."""
    from .patch_ffn import waiting_modules

    modules = waiting_modules()
    if modules:
        from .module_paths import calling_model

        # No model on the stack (a compiled method): each under the module torch.compile was handed.
        _register_waiting(calling_model(), modules)


def _watch_compiles() -> None:
    """``_on_compile_start`` among Dynamo's start callbacks (again after ``torch._dynamo.reset()``,
    which clears them)."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    callbacks = getattr(handler, "start_callbacks", None)
    with _lock:
        if isinstance(callbacks, list) and _on_compile_start not in callbacks:
            handler.register_start_callback(_on_compile_start)


class _FirstCompiledCall:
    """One-shot hooks on what ``torch.compile`` returned, run outside the compiled code: before
    the first call, register the layers patched for it (under the calling model, so inside the
    compiled region they are known); after it, warn if no FFN of the model was rewritten."""

    def __init__(self, target, patched: list, skipped: list, check: bool):
        self.target = weakref.ref(target)
        self.patched = [weakref.ref(m) for m in patched]
        self.skipped = skipped
        self.check = check
        self.before_handle = self.after_handle = None

    def attach(self, compiled) -> None:
        if not isinstance(compiled, torch.nn.Module):
            self.register()  # nothing to hook: under the module compiled
            return
        _seen.add(compiled)
        if self.patched:
            self.before_handle = compiled.register_forward_pre_hook(self.before)
        if self.check:
            self.after_handle = compiled.register_forward_hook(self.after)

    def register(self, model=None) -> None:
        modules = [m for m in (ref() for ref in self.patched) if m is not None]
        self.patched = []
        _register_waiting(model if model is not None else self.target(), modules, self.skipped)

    def before(self, module, args):
        if not torch.compiler.is_compiling():
            from .module_paths import calling_model

            self.register(calling_model())
            self.before_handle.remove()
        return None

    def after(self, module, args, output):
        if torch.compiler.is_compiling():
            return None
        from . import layers
        from .module_paths import calling_model, unwrap

        self.after_handle.remove()
        target = self.target()
        models = {calling_model(), None if target is None else unwrap(target)}
        if target is not None and not any(layers.model_of(m).layers for m in models if m is not None):
            _warn_nothing_matched(target, self.skipped, compiled=True)
        return None


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
