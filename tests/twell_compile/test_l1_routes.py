"""The L1 term is one definition on every route: the mean over the model's FFN layers.

The same model must get the same gradients whether it is compiled whole, compiled per layer
(FSDP2 / torchtitan style), split by a graph break between its layers, or eagerly patched, and
equal to eager autograd of ``loss + l1_coeff · mean_l (1/T) Σ|h_l|`` (docs/architecture.md, "The
L1 regularizer"). With ``l1_coeff = 0.25`` dropping the term, or counting it per graph, moves the
gradients far outside the tolerances below.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import twell_compile
from twell_compile import SkipReason, TwellRewriteError

from tests.ffn_models import GatedFFN, PlainFFN, ResidualStack, assert_grads_close, eager_loss, reset_state

D, H, L1 = 16, 40, 0.25
OPTIONS = {"inner": "aot_eager", "l1_coeff": L1}


@pytest.fixture(autouse=True)
def fresh():
    reset_state()
    yield
    reset_state()


class BrokenStack(ResidualStack):
    """A graph break between every two layers: each FFN lands in a graph of its own."""

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
            torch._dynamo.graph_break()
        return x


class CheckpointedStack(ResidualStack):
    """Each layer under non-reentrant activation checkpointing: Dynamo traces it as a
    ``tag_activation_checkpoint`` body, which the backend rewrites like the graph itself."""

    checkpointed = True

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            x = x + (checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x))
        return x


def _model(cls=ResidualStack):
    torch.manual_seed(0)
    return cls(D, H, n=3, kinds=("gated", "plain"))


def _loss(out):
    return out.square().mean()


def _compile_whole(model):
    return torch.compile(model, backend="twell", options=OPTIONS)


def _compile_per_layer(model):
    for layer in model.layers:
        layer.compile(backend="twell", options=OPTIONS)
    return model


def _patched(model):
    twell_compile.patch(model, l1_coeff=L1)
    return model


ROUTES = {
    "whole model": (ResidualStack, _compile_whole),
    "per layer": (ResidualStack, _compile_per_layer),
    "graph breaks between layers": (BrokenStack, _compile_whole),
    "patch": (ResidualStack, _patched),
    "activation checkpointing": (CheckpointedStack, _compile_whole),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_route_gives_the_eager_gradients_of_the_mean_over_layers(route):
    cls, prepare = ROUTES[route]
    model = _model(cls)
    ref = copy.deepcopy(model)
    ref.checkpointed = False  # the oracle's hooks must not run again in a recomputation
    x = torch.randn(2, 5, D)
    run = prepare(model)
    for step in range(2):  # the second step reuses the compiled graphs
        model.zero_grad()
        ref.zero_grad()
        _loss(run(x)).backward()
        eager_loss(ref, lambda: ref(x), _loss, L1).backward()
        assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5, prefix=f"step {step}: ")
    assert len(twell_compile.report().rewritten) == 3


@pytest.mark.parametrize("route", list(ROUTES))
def test_layers_are_named_by_their_full_path_on_every_route(route):
    cls, prepare = ROUTES[route]
    model = _model(cls)
    prepare(model)(torch.randn(3, D)).sum().backward()
    names = ["layers.0", "layers.1", "layers.2"]
    assert [r.where for r in twell_compile.report().rewritten] == names
    assert [s.where for s in twell_compile.stats().layers] == names


class Block(nn.Module):
    """A torchtitan-style decoder block: nothing in it differs from one block to the next, so
    Dynamo would serve every block the graph it compiled for the first."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = GatedFFN(D, H)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Blocks(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _break_before(attr):
    def prepare(model):
        for block in model.layers:
            target = block if attr is None else getattr(block, attr)
            target.register_forward_pre_hook(lambda mod, args: torch._dynamo.graph_break())
        return _compile_whole(model)

    return prepare


IDENTICAL_BLOCK_ROUTES = {
    "per block": _compile_per_layer,
    "graph break before each block": _break_before(None),
    "graph break before each FFN": _break_before("mlp"),
}


@pytest.mark.parametrize("route", list(IDENTICAL_BLOCK_ROUTES))
def test_identical_blocks_each_get_their_own_layer(route):
    """More blocks than Dynamo's recompile limit (8), an input that requires grad (so no block
    differs from the next in what Dynamo guards): every block must still be its own layer, and
    the term the mean over all of them."""
    n = torch._dynamo.config.recompile_limit + 2
    torch.manual_seed(0)
    model = Blocks(n)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, D, requires_grad=True)
    _loss(IDENTICAL_BLOCK_ROUTES[route](model)(x)).backward()
    names = [f"layers.{i}.mlp" for i in range(n)]
    assert sorted(r.where for r in twell_compile.report().rewritten) == sorted(names)
    assert [s.where for s in twell_compile.stats().layers] == names
    assert all(s.calls == 1 for s in twell_compile.stats().layers)
    eager_loss(ref, lambda: ref(x), _loss, L1).backward()
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


def test_graph_count_does_not_change_the_term():
    """Three graphs or one: the per-layer weight is l1_coeff / 3 either way (it used to be the
    number of FFNs in each graph, so per-layer compile tripled the term)."""
    grads = []
    for cls, prepare in (ROUTES["whole model"], ROUTES["per layer"]):
        reset_state()
        model = _model(cls)
        _loss(prepare(model)(torch.randn(4, D, generator=torch.Generator().manual_seed(3)))).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_module_called_twice_adds_two_l1_terms_on_every_route():
    """One semantics for a module called several times per forward: each call adds its L1 term,
    weighted by 1 / (the model's distinct FFN layers)."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.ffn = GatedFFN(D, H)
            self.other = PlainFFN(D, H)

        def forward(self, x):
            x = x + self.ffn(x)
            x = x + self.other(x)
            return x + self.ffn(x)

    torch.manual_seed(0)
    base = Twice()
    x = torch.randn(3, D)
    ref = copy.deepcopy(base)
    calls = [ref.ffn, ref.other, ref.ffn]
    hiddens = []
    handles = [m.register_forward_hook(lambda mod, a, out: hiddens.append(mod.hidden(a[0]))) for m in (ref.ffn, ref.other)]
    loss = _loss(ref(x))
    for h in handles:
        h.remove()
    assert len(hiddens) == len(calls)
    l1 = sum(h.abs().sum() / h.shape[0] for h in hiddens) / 2  # two distinct layers
    (loss + L1 * l1).backward()

    results = {}
    for name, prepare in (("compile", _compile_whole), ("patch", _patched)):
        reset_state()
        model = copy.deepcopy(base)
        _loss(prepare(model)(x)).backward()
        assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5, prefix=f"{name}: ")
        results[name] = {s.where for s in twell_compile.stats().layers}
    assert results["compile"] == results["patch"] == {"ffn", "other"}


@pytest.mark.parametrize("cut", ["after the gate projection", "after the ReLU", "after the up projection",
                                 "after the product"])
def test_an_ffn_cut_by_a_graph_break_is_reported_as_such(cut):
    class Cut(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x):
            g = self.gate(x)
            if cut == "after the gate projection":
                torch._dynamo.graph_break()
            a = torch.relu(g)
            if cut == "after the ReLU":
                torch._dynamo.graph_break()
            u = self.up(x)
            if cut == "after the up projection":
                torch._dynamo.graph_break()
            h = a * u
            if cut == "after the product":
                torch._dynamo.graph_break()
            return self.down(h)

    with pytest.warns(RuntimeWarning, match="no FFN of Cut has been rewritten.*graph boundary"):
        torch.compile(Cut(), backend="twell", options=OPTIONS)(torch.randn(2, D, requires_grad=True)).sum().backward()
    report = twell_compile.report()
    assert not report.rewritten
    assert [s.reason for s in report.skipped] == [SkipReason.GRAPH_SPLIT]
    assert "optimize_ddp" in SkipReason.GRAPH_SPLIT.text and "patch" in SkipReason.GRAPH_SPLIT.text
    from tests.ffn_models import unwrap

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(Cut(), backend="twell", options={**OPTIONS, "strict": True})(torch.randn(2, D)).sum()
    assert isinstance(unwrap(info.value), TwellRewriteError)


def test_a_tensor_parallel_ffn_is_reported_as_such():
    """``parallelize_module`` hands the projections DTensor weights, which the ops do not take."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = nn.Sequential(GatedFFN(D, H))
        parallelize_module(model[0], init_device_mesh("cpu", (1,)),
                           {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
        with pytest.warns(RuntimeWarning, match="tensor parallelism"):
            torch.compile(model, backend="twell", options=OPTIONS)(torch.randn(2, D)).sum().backward()
    finally:
        dist.destroy_process_group()
    report = twell_compile.report()
    assert not report.rewritten
    assert [s.reason for s in report.skipped] == [SkipReason.TENSOR_PARALLEL]


def test_the_nothing_rewritten_warning_comes_once_and_strict_raises():
    class NearMiss(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x):
            h = torch.relu(self.up(x))
            return self.down(h), h.mean()

    model = NearMiss()
    compiled = torch.compile(model, backend="twell", options=OPTIONS)
    with pytest.warns(RuntimeWarning, match="another user"):
        compiled(torch.randn(2, D))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(model, backend="twell", options=OPTIONS)(torch.randn(2, D))  # the same model and reason: no repeat
    torch._dynamo.reset()
    from tests.ffn_models import unwrap

    with pytest.raises(Exception) as info:
        torch.compile(model, backend="twell", options={**OPTIONS, "strict": True})(torch.randn(2, D))
    assert isinstance(unwrap(info.value), TwellRewriteError)


def test_patch_records_a_module_it_cannot_trace():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
                x = -x
            return self.down(torch.relu(self.up(x)))

    result = twell_compile.patch(nn.Sequential(Untraceable()))
    assert [s.reason for s in result.skipped] == [SkipReason.TRACE_FAILED]
    assert "0" in result.skipped[0].where


def test_two_models_keep_separate_layer_counts():
    """A second model (a teacher, an EMA copy) has its own mean over its own layers."""
    small = nn.Sequential(GatedFFN(D, H))
    big = _model()
    ref_small, ref_big = copy.deepcopy(small), copy.deepcopy(big)
    x = torch.randn(3, D)
    twell_compile.patch(small, l1_coeff=L1)
    twell_compile.patch(big, l1_coeff=L1)
    (_loss(small(x)) + _loss(big(x))).backward()
    eager_loss(ref_small, lambda: ref_small(x), _loss, L1).backward()
    eager_loss(ref_big, lambda: ref_big(x), _loss, L1).backward()
    assert_grads_close(small, ref_small, rtol=1e-4, atol_frac=1e-5)
    assert_grads_close(big, ref_big, rtol=1e-4, atol_frac=1e-5)
    assert {s.model for s in twell_compile.stats().layers} == {"Sequential", "ResidualStack"}
    assert len(twell_compile.stats(big).layers) == 3
