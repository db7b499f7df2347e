"""Hook run by torch at the end of ``import torch`` (entry point group ``torch.backends``).

It does nothing unless ``TWELL`` is set to a true value, and it never raises an exception: one
here would abort ``import torch`` for every program in the environment. A ``TWELL`` or
``TWELL_*`` value that is not accepted stops the process instead, with one line on stderr that
names the variable and exit status 2, before the script does any work: a typo such as
``TWELL=flase`` must neither switch twell on nor train silently without it. This also stops a
tool that imports torch only to inspect it while such a value is set (docs/usage.md says so).
"""

from __future__ import annotations

import os
import sys
import warnings


def autoload() -> None:
    try:
        if "TWELL" not in os.environ:
            return
        from .options import env_flag

        try:
            enabled = env_flag("TWELL")
        except ValueError as exc:
            sys.stderr.write(f"{exc}\n")
            raise SystemExit(2) from None
        if not enabled:
            return
        from .activate import activate_from_env

        activate_from_env()
    except SystemExit:
        raise  # an invalid TWELL* value stops the run with a message naming the variable
    except Exception as exc:  # noqa: BLE001 - never break `import torch`
        warnings.warn(f"twell: TWELL=1 autoload failed and is disabled: {exc!r}", RuntimeWarning, stacklevel=2)
