"""Training-framework integrations: a Hugging Face ``TrainerCallback`` and a Lightning ``Callback``.

``TwellCallback`` does two things for a ``transformers.Trainer`` run:

* it tells twell the loss scale of gradient accumulation, ``1 / gradient_accumulation_steps``
  (the Trainer divides each micro-batch's loss by it, or normalises it by the accumulated batch's
  token count, which is the same for micro-batches of equal size), so the injected L1 term sums
  to one step on the whole batch (docs/usage.md, "Loss scaling");
* at each logging step it adds twell's telemetry to the Trainer's logs and ``state.log_history``,
  means over the rewritten layers:
  ``twell/density``, ``twell/l0`` (active neurons per token), ``twell/l1``, ``twell/l1_coeff``,
  ``twell/dead_neurons``, ``twell/dense_rows`` and ``twell/sparse_layers`` (how many layers ran the
  sparse path), and per layer ``twell/sparse/<layer path>`` (1: sparse, 0: dense; off with
  ``TwellCallback(layer_paths=False)``). Reading them waits for the device, at the step where the
  Trainer itself reads the loss.

A callback sees ``logs`` after the callbacks before it in the Trainer's list, and the Trainer
puts those passed as ``callbacks=[...]`` after its reporting integrations (TensorBoard, W&B, ...).
So when the Trainer finishes its set-up and again when training begins, ``TwellCallback`` moves
itself to the front of the list, and every logger receives its keys.

Under ``TWELL=1`` the callback is added to the Trainer on the model's first call. Otherwise::

    >>> from twell_compile.integrations import TwellCallback
    >>> trainer = Trainer(model=model, args=args, ..., callbacks=[TwellCallback()])

``TwellLightningCallback`` does the same for a Lightning ``Trainer``: under automatic
optimization Lightning divides each micro-batch's loss by ``accumulate_grad_batches``, and the
callback sets twell's loss scale to match before each batch; every ``log_every_n_steps`` steps it
logs the same numbers through ``LightningModule.log_dict``. Under manual optimization the training
step runs its own backward, so the scale stays the user's (``set_loss_scale``, ``loss_scale``).
Under ``TWELL=1`` it is added to the Trainer on the model's first call. Otherwise::

    >>> from twell_compile.integrations import TwellLightningCallback
    >>> trainer = lightning.pytorch.Trainer(..., callbacks=[TwellLightningCallback()])

transformers and Lightning are imported only when their callback is first used (``lightning``, or
``pytorch_lightning`` when only that one is imported or installed).
"""

from __future__ import annotations

import functools
import statistics
import sys
from typing import Optional


def telemetry_logs(model=None, layer_paths: bool = False) -> dict[str, float]:
    """twell's telemetry as flat ``twell/...`` numbers: means over the (model's) rewritten layers,
    and with ``layer_paths`` each layer's path as ``twell/sparse/<layer path>`` (1.0 or 0.0)."""
    from .reporting import stats

    layers = stats(model).layers
    if not layers:
        return {}

    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None

    logs = {
        "twell/density": mean(s.density for s in layers),
        "twell/l0": mean(s.l0 for s in layers),
        "twell/l1": mean(s.l1 for s in layers),
        "twell/l1_coeff": mean(s.l1_coeff for s in layers),
        "twell/dead_neurons": mean(s.dead_neurons for s in layers),
        "twell/dense_rows": mean(s.dense_rows for s in layers),
        "twell/sparse_layers": float(sum(s.path == "sparse" for s in layers)),
    }
    if layer_paths:  # numbers, not a string: MLflow and others drop (and warn about) strings
        logs.update({f"twell/sparse/{s.where}": float(s.path == "sparse") for s in layers})
    return {k: v for k, v in logs.items() if v is not None}


@functools.lru_cache(maxsize=None)
def _callback_class():
    from transformers import TrainerCallback

    from .loss_scaling import set_loss_scale

    class TwellCallback(TrainerCallback):
        """Gradient accumulation's loss scale for twell's L1 term, and twell's telemetry in the logs."""

        def __init__(self, layer_paths: bool = True):
            self.layer_paths = layer_paths

        def on_init_end(self, args, state, control, **kwargs):
            _move_to_front(self)

        def on_train_begin(self, args, state, control, **kwargs):
            _move_to_front(self)  # again: the user may have added it after the Trainer's set-up
            set_loss_scale(1.0 / max(1, args.gradient_accumulation_steps))

        def on_step_begin(self, args, state, control, **kwargs):
            set_loss_scale(1.0 / max(1, args.gradient_accumulation_steps))

        def on_train_end(self, args, state, control, **kwargs):
            set_loss_scale(1.0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            found = telemetry_logs(kwargs.get("model"), layer_paths=self.layer_paths)
            if logs is not None:
                logs.update(found)  # what the callbacks after this one report
            if state.log_history:
                state.log_history[-1].update(found)  # the Trainer appended its copy before the callbacks ran

    TwellCallback.__module__ = __name__
    return TwellCallback


def _move_to_front(callback) -> None:
    """Put ``callback`` first in the list of the ``CallbackHandler`` calling it (found on the
    stack, as the handler passes no reference to itself): the loggers after it then receive what
    its ``on_log`` adds. The handler gets a new list, so an event iterating the old one is
    undisturbed."""
    from transformers.trainer_callback import CallbackHandler

    frame = sys._getframe(1)
    while frame is not None:
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler) and any(cb is callback for cb in handler.callbacks):
            if handler.callbacks[0] is not callback:
                handler.callbacks = [callback, *(cb for cb in handler.callbacks if cb is not callback)]
            return
        frame = frame.f_back


def attach_to_running_trainer() -> bool:
    """Under ``TWELL=1``: add ``TwellCallback`` to a ``transformers.Trainer`` whose training loop is
    on the stack (the model's first call happens inside it), or ``TwellLightningCallback`` to a
    Lightning ``Trainer``, and set this step's loss scale, which the callback sets from the next
    step on. True if one was found."""
    transformers = sys.modules.get("transformers")
    trainer_cls = getattr(transformers, "Trainer", None) if transformers is not None else None
    trainer = None if trainer_cls is None else _trainer_on_stack(trainer_cls)
    if trainer is None:
        return _attach_to_running_lightning_trainer()
    cls = _callback_class()
    callbacks = trainer.callback_handler.callbacks
    if not any(isinstance(cb, cls) for cb in callbacks):
        callbacks.insert(0, cls())  # first: the loggers after it report its numbers
    from .loss_scaling import set_loss_scale

    set_loss_scale(1.0 / max(1, trainer.args.gradient_accumulation_steps))
    return True


def _trainer_on_stack(trainer_cls) -> Optional[object]:
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, trainer_cls):
            return candidate
        frame = frame.f_back
    return None


LIGHTNING_MODULES = ("lightning.pytorch", "pytorch_lightning")


def _lightning() -> "object":
    """The Lightning package in use: one already imported (``lightning.pytorch`` first), else the
    first importable."""
    import importlib

    for name in LIGHTNING_MODULES:
        if name in sys.modules:
            return sys.modules[name]
    for name in LIGHTNING_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("TwellLightningCallback needs Lightning: pip install lightning")


@functools.lru_cache(maxsize=None)
def _lightning_callback_class(package: str):
    import importlib

    from .loss_scaling import set_loss_scale

    callback_base = importlib.import_module(package).Callback  # the Trainer checks the class it subclasses

    class TwellLightningCallback(callback_base):
        """Gradient accumulation's loss scale for twell's L1 term, and twell's telemetry in the logs."""

        def __init__(self, layer_paths: bool = True):
            self.layer_paths = layer_paths
            self._logged_step = -1

        def on_train_start(self, trainer, pl_module):
            _lightning_accumulation_scale(trainer, pl_module)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            _lightning_accumulation_scale(trainer, pl_module)  # it may change by epoch (a scheduler)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step == self._logged_step or step % max(1, trainer.log_every_n_steps):
                return
            self._logged_step = step
            logs = telemetry_logs(pl_module, layer_paths=self.layer_paths) or telemetry_logs(layer_paths=self.layer_paths)
            if logs:
                pl_module.log_dict(logs, on_step=True, on_epoch=False)

        def on_train_end(self, trainer, pl_module):
            if pl_module.automatic_optimization:
                set_loss_scale(1.0)

    TwellLightningCallback.__module__ = __name__
    return TwellLightningCallback


def _attach_to_running_lightning_trainer() -> bool:
    for package in LIGHTNING_MODULES:
        module = sys.modules.get(package)
        trainer = None if module is None else _trainer_on_stack(module.Trainer)
        if trainer is None:
            continue
        cls = _lightning_callback_class(package)
        if not any(isinstance(cb, cls) for cb in trainer.callbacks):
            trainer.callbacks.append(cls())
        if trainer.lightning_module is not None:
            _lightning_accumulation_scale(trainer, trainer.lightning_module)
        return True
    return False


def _lightning_accumulation_scale(trainer, pl_module) -> None:
    """Lightning's automatic optimization divides each micro-batch's loss by
    ``accumulate_grad_batches``; under manual optimization the training step runs its own backward."""
    if pl_module.automatic_optimization:
        from .loss_scaling import set_loss_scale

        set_loss_scale(1.0 / max(1, trainer.accumulate_grad_batches))


def __getattr__(name: str):
    if name == "TwellCallback":
        return _callback_class()
    if name == "TwellLightningCallback":
        return _lightning_callback_class(_lightning().__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
