"""TwELL ops: ``torch.library`` schemas, fake impls, autograd with the injected L1, device dispatch.

Importing this package registers ``torch.ops.twell.ffn``, ``torch.ops.twell.ffn_train`` and
``torch.ops.twell.ffn_bwd``. This layer knows nothing about FX graphs.
"""

from . import telemetry
from .ffn import ffn
from .ffn_bwd import ffn_bwd
from .ffn_train import ffn_train

__all__ = ["ffn", "ffn_bwd", "ffn_train", "telemetry"]
