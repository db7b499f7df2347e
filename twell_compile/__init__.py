"""twell-compile: run ReLU feed-forward blocks sparse, with no change to the model code.

Use ``torch.compile(model, backend="twell")`` (no import needed once installed), or ``TWELL=1`` in
front of an unmodified script, or ``twell_compile.patch(model)`` for scripts that never compile.

The public names load lazily: torch imports ``twell_compile.autoload`` at the end of every
``import torch``, and that must stay cheap when ``TWELL`` is not set.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    # configuration
    "TwellOptions": "options",
    "set_l1_coeff": "l1",
    "set_loss_scale": "loss_scaling",
    "get_loss_scale": "loss_scaling",
    "loss_scale": "loss_scaling",
    # top level UX
    "patch": "patch_ffn",
    "report": "reporting",
    "reset": "reporting",
    "stats": "reporting",
    # types
    "LayerStats": "reporting",
    "PatchResult": "patch_ffn",
    "Report": "reporting",
    "Rewritten": "reporting",
    "SkipReason": "reporting",
    "Skipped": "reporting",
    "Stats": "reporting",
    "TwellRewriteError": "rewrite_ffn",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'twell_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
