"""How the TwELL ops' autograd kernels dispatch: the implementation called directly where nothing
traces or transforms (host time), the op itself below autograd otherwise, so that graphs record it.

The ops are defined with ``torch.library.Library`` and an autograd kernel of their own rather than
``torch.library.custom_op``, whose wrappers run on every call (docs/design-notes.md).
"""

from __future__ import annotations

import torch

FUNCTORCH_UNSUPPORTED = (
    "twell: torch.func transforms (grad, vmap, jacrev, functional_call under grad, ...) cannot "
    "differentiate through the TwELL ops; run that computation on a model that is not patched or "
    "compiled with backend='twell'")

# Tensor types that are real tensors: a model's weights are Parameters (no dispatch override).
_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


def real_tensors(args) -> bool:
    """Real tensors (``Tensor`` or ``Parameter``: not fake, functional or other subclasses), and
    nothing tracing or transforming: an op's implementation may then be called directly."""
    if torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active():
        return False
    return all(type(a) in _PLAIN_TENSORS for a in args if isinstance(a, torch.Tensor))


def plain_eager(args) -> bool:
    """``real_tensors(args)`` with grad mode off (with ``create_graph=True`` the backward op raises
    its double-backward error)."""
    return not torch.is_grad_enabled() and real_tensors(args)


def below_autograd(op, keyset, args):
    """The op overload ``op`` itself, dispatched past its autograd kernel (to its implementation,
    or to a tracer's or fake tensors' handler)."""
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)


def autograd_kernel(function, impl, op, keyset, args):
    """An op's autograd kernel: ``function`` (an ``autograd.Function`` taking the keyset first)
    where grad is recorded; else the implementation itself on real tensors, with no second
    dispatch; else the op below autograd (tracers, fake tensors)."""
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        if torch._C._are_functorch_transforms_active():
            raise RuntimeError(FUNCTORCH_UNSUPPORTED)
        return function.apply(keyset, *args)
    if real_tensors(args):
        return impl(*args)
    return below_autograd(op, keyset, args)
