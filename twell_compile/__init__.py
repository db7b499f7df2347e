"""twell-compile: run ReLU feed-forward blocks sparse, with no change to the model code.

Use ``torch.compile(model, backend="twell")`` (no import needed once installed), or ``TWELL=1`` in
front of an unmodified script, or ``twell_compile.patch(model)`` for scripts that never compile.
"""

from .l1 import set_l1_coeff
from .options import TwellOptions
from .reporting import LayerStats, Report, Rewritten, Skipped, SkipReason, Stats, report, reset, stats


def patch(model, **options):
    """Rewrite the FFN modules of ``model`` eagerly (no compile). See ``twell_compile.patch_ffn``."""
    from .patch_ffn import patch as _patch

    return _patch(model, **options)


__all__ = [
    # configuration
    "TwellOptions",
    "set_l1_coeff",
    # top level UX
    "patch",
    "report",
    "reset",
    "stats",
    # types
    "LayerStats",
    "Report",
    "Rewritten",
    "SkipReason",
    "Skipped",
    "Stats",
]
