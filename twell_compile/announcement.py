"""What ``TWELL=1`` says on stderr: one line per model and route (eager patch, compiled graphs)
at its first rewrite, with what was rewritten, how many patterns were skipped and the L1
coefficient; nothing with ``TWELL_QUIET=1``, nor unless ``TWELL=1`` activated twell.

The activation (``activate.py``) hands in its options (``start``); every route that rewrites (the
eager patch, the pre-grad pass, the backend) calls ``announce``. A file of its own, so that those
routes do not import the activation, which imports them.
"""

from __future__ import annotations

import sys
import threading
from typing import Optional

from .options import TwellOptions, quiet

_lock = threading.Lock()
_options: Optional[TwellOptions] = None  # the TWELL_* options, once TWELL=1 activated twell
_announced: set = set()  # (the layer registry's model entry, compiled) pairs already announced


def start(options: TwellOptions) -> None:
    """``TWELL=1`` activated twell with ``options``: from now on, rewrites are announced."""
    global _options
    _options = options


def announce(rewritten, skipped, *, note: str = "") -> None:
    """One line on stderr per model and route, at its first rewrite: what ``TWELL=1`` did. Every
    route that rewrites calls it; it prints nothing unless ``TWELL=1`` activated twell, nor with
    ``TWELL_QUIET=1``."""
    if _options is None or not rewritten or quiet():
        return
    # Here, not at the top: TWELL=1 imports this module at the end of ``import torch``, where the
    # rewrite's modules (and through them Triton) would slow every script down.
    from . import layers
    from .reporting import name_pattern

    groups: dict = {}
    for r in rewritten:
        entry = layers.layer(r.layer)
        model = entry.model if entry is not None else None
        groups.setdefault((model, r.graph != "patch"), []).append(r)
    for (model, compiled), found in groups.items():
        with _lock:
            if (model, compiled) in _announced:
                continue
            _announced.add((model, compiled))
        owner = f" of {model.label}" if model is not None and model.module is not None else ""
        route = " in compiled graphs" if compiled else ""
        names = found[0].where if len(found) == 1 else name_pattern([r.where for r in found])
        sys.stderr.write(f"twell: rewrote {len(found)} FFN(s){owner} ({names}){route}, skipped {len(skipped)}; "
                         f"l1_coeff {_options.l1_coeff:g}{note} (twell_compile.report() has the details; "
                         "TWELL_QUIET=1 silences this)\n")
