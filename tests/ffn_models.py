"""Tiny FFN models and eager oracles shared by the lowering, twell_compile and e2e tests.

* ``GatedFFN`` / ``PlainFFN``: the two FFN shapes the matcher rewrites, as ``nn.Linear`` modules,
  each with ``hidden(x)``, the ``h`` whose L1 the backend regularises (docs/architecture.md, 'The L1 regularizer').
* ``ResidualStack``: ``n`` FFNs in one graph, so the L1 mean over layers matters.
* ``eager_loss``: the training oracle, ``loss + l1_coeff · mean_l (1/T) Σ_t Σ_j |h_l[t, j]|``,
  with ``h_l`` recorded by forward hooks while the eager model runs.
* ``assert_close``: ``tests.utils.assert_close_verbose`` when it is there, else ``torch.testing``.
* ``unwrap``: the exception a backend raised, from Dynamo's ``BackendCompilerFailed`` wrapper.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tests.utils import assert_close_verbose


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, name: str = "") -> None:
    """Elementwise ``|a − e| <= atol + rtol·|e|`` in float64, printing the worst elements on failure."""
    assert_close_verbose(actual, expected, rtol=rtol, atol=atol, name=name)


def assert_grads_close(model: nn.Module, ref: nn.Module, *, rtol: float, atol_frac: float, prefix: str = "") -> None:
    """Every parameter gradient of ``model`` matches ``ref``'s (same names), atol relative to its scale."""
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        q = ref_params[name]
        assert (p.grad is None) == (q.grad is None), f"{prefix}{name}: grad presence differs"
        if p.grad is None:
            continue
        scale = float(q.grad.detach().abs().max()) if q.grad.numel() else 0.0
        assert_close(p.grad, q.grad, rtol=rtol, atol=atol_frac * (1.0 + scale), name=f"{prefix}grad {name}")
        checked += 1
    assert checked, "no gradients to compare"


def unwrap(exc: BaseException) -> BaseException:
    """The backend's own exception: Dynamo wraps every backend error in ``BackendCompilerFailed``."""
    inner = getattr(exc, "inner_exception", None)
    return unwrap(inner) if isinstance(inner, BaseException) else exc


def reset_state() -> None:
    """Forget compiled graphs and what the twell backend recorded."""
    import twell_compile

    torch._dynamo.reset()
    twell_compile.reset()


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class GatedFFN(nn.Module):
    """``down(relu(gate(x)) * up(x))``: the HF Llama MLP with ``hidden_act="relu"``."""

    def __init__(self, d: int = 16, h: int = 40, *, bias: bool | tuple[bool, bool, bool] = True):
        super().__init__()
        bg, bu, bd = (bias,) * 3 if isinstance(bias, bool) else bias
        self.gate = nn.Linear(d, h, bias=bg)
        self.up = nn.Linear(d, h, bias=bu)
        self.down = nn.Linear(h, d, bias=bd)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.gate(x)) * self.up(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.gate(x)) * self.up(x))


class PlainFFN(nn.Module):
    """``down(relu(up(x)))``: the classic Transformer MLP."""

    def __init__(self, d: int = 16, h: int = 40, *, bias: bool | tuple[bool, bool] = True):
        super().__init__()
        bu, bd = (bias,) * 2 if isinstance(bias, bool) else bias
        self.up = nn.Linear(d, h, bias=bu)
        self.down = nn.Linear(h, d, bias=bd)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.up(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class ResidualStack(nn.Module):
    """``x + ffn_l(x)`` for ``n`` FFNs (gated or plain, alternating when ``kinds`` says so)."""

    def __init__(self, d: int = 16, h: int = 40, n: int = 3, kinds: Iterable[str] = ("gated",), bias: bool = True):
        super().__init__()
        kinds = list(kinds)
        self.layers = nn.ModuleList(
            [(GatedFFN if kinds[i % len(kinds)] == "gated" else PlainFFN)(d, h, bias=bias) for i in range(n)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def ffn_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (GatedFFN, PlainFFN))]


# ---------------------------------------------------------------------------------------------
# The L1 oracle (docs/architecture.md, 'The L1 regularizer')
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording_hiddens(modules: Iterable[nn.Module], hidden_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
    """Record ``hidden_fn(module, input)`` (the FFN's ``h``) for each call of ``modules``."""
    hiddens: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda mod, args, out: hiddens.append(hidden_fn(mod, args[0]))) for m in modules]
    try:
        yield hiddens
    finally:
        for handle in handles:
            handle.remove()


def l1_term(hiddens: list[torch.Tensor]) -> torch.Tensor:
    """``mean over layers of (1/T) Σ_t Σ_j |h[t, j]|``; T = all leading dims of h."""
    assert hiddens, "no FFN ran"
    per_layer = [h.abs().sum() / max(1, h[..., 0].numel()) for h in hiddens]
    return torch.stack([v.float() for v in per_layer]).mean()


def eager_loss(
    model: nn.Module,
    run: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    l1_coeff: float,
    modules: Optional[Iterable[nn.Module]] = None,
    hidden_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda m, x: m.hidden(x),
) -> torch.Tensor:
    """``loss_fn(run()) + l1_coeff · L1`` computed eagerly, the quantity whose gradient twell must give."""
    modules = ffn_modules(model) if modules is None else list(modules)
    with recording_hiddens(modules, hidden_fn) as hiddens:
        out = run()
    loss = loss_fn(out)
    if l1_coeff:
        loss = loss + l1_coeff * l1_term(hiddens)
    return loss
