"""Preparing a layer compiled for CUDA graphs to record the sparse path (``prepare_capture``).

Inductor's cudagraph trees warm each graph up with one eager call, then record it. A layer's
density is known only one call late, and autotuning cannot run inside a capture, so without this
the recording would take the dense path.
"""

from __future__ import annotations

import warnings

import torch

from twell_compile.kernels import CallRecord

from . import dispatch_policy
from .handoff import remember
from .sparse_path import sparse_backward, sparse_forward


def prepare_capture(policy: dispatch_policy.LayerPolicy, x2d, wg, wu, wd, bg, bu, bd, sparse: bool, training: bool,
                    signature: tuple, layer: int) -> None:
    """On the eager warm-up call of a layer compiled for CUDA graphs (outside capture), after the
    call's own work (``sparse``: the path it took; ``signature``: its problem's):

    * the layer's first counters are waited for (a host sync, on its first call only), so that
      the capture knows its density;
    * if the policy then picks sparse for a capture (``LayerPolicy.choose_captured``) for a
      problem whose sparse kernels never ran, they run once on the same inputs (forward and, in
      training, backward with a zero ``dout``), results and counters discarded; the call's own
      result is the one already computed.
    """
    if not policy.measured:
        policy.settle()
    picks_sparse = policy.choose_captured(training, x2d.shape[0])  # reads the counters now, while not capturing
    if sparse or not picks_sparse or dispatch_policy.is_warm(signature):
        return
    dev = x2d.device
    try:
        scratch = CallRecord(torch.zeros(5, dtype=torch.float64, device=dev), torch.zeros(3, dtype=torch.int64, device=dev), 1.0)
        res = sparse_forward(x2d, wg, wu, wd, bg, bu, bd, training, False, scratch, keep=False)
        dispatch_policy.WARM.add(("forward", *signature))
        if training:
            remember(res.packed.count, False)
            zero = torch.zeros((), dtype=torch.float32, device=dev)
            sparse_backward(torch.zeros_like(res.out), x2d, wg, wu, wd, bg, bu, bd, res.packed, res.up_val, zero,
                            layer=layer)
    except torch.cuda.OutOfMemoryError:
        # The call's own result is already computed: losing the tuning only costs speed.
        warnings.warn(f"twell: layer {layer}: not enough GPU memory to tune its sparse kernels before CUDA-graph "
                      "capture; it records the dense path", RuntimeWarning, stacklevel=2)
