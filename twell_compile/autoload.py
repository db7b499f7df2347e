"""Hook run by torch at the end of ``import torch`` (entry point group ``torch.backends``).

It does nothing unless ``TWELL`` is set, and it never raises: an exception here would abort
``import torch`` for every program in the environment.
"""

from __future__ import annotations

import os
import warnings


def autoload() -> None:
    try:
        if os.environ.get("TWELL", "").strip().lower() in ("", "0", "false", "off", "no"):
            return
        from .activate import activate_from_env

        activate_from_env()
    except SystemExit:
        raise  # an invalid TWELL_* value stops the run with a message naming the variable
    except Exception as exc:  # noqa: BLE001 - never break `import torch`
        warnings.warn(f"twell: TWELL=1 autoload failed and is disabled: {exc!r}", RuntimeWarning, stacklevel=2)
