"""The ``twell`` backend end to end: registration, options, inner compilers, L1 semantics, report, stats.

The L1 oracle is docs/architecture.md, 'The L1 regularizer': training gradients equal eager autograd of
``loss + l1_coeff · mean_over_rewritten_layers((1/T) Σ_t Σ_j |h[t, j]|)``.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import twell_compile
from twell_compile.options import TwellOptions

from tests.ffn_models import (
    GatedFFN,
    PlainFFN,
    ResidualStack,
    assert_close,
    assert_grads_close,
    eager_loss,
    ffn_modules,
    reset_state,
    unwrap,
)

D, H = 16, 40


@pytest.fixture(autouse=True)
def _fresh():
    reset_state()
    yield
    twell_compile.set_l1_coeff(0.0)  # leave no live coefficient behind at a surprising value
    reset_state()


@pytest.fixture
def no_inductor_caches(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    with torch.compiler.config.patch(force_disable_caches=True):
        yield


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def train_step(model, fn, x, l1_coeff=0.0):
    """Zero the grads, run one loss (+ the eager L1 when ``l1_coeff``) backward; return the output."""
    model.zero_grad(set_to_none=True)
    if l1_coeff:
        loss = eager_loss(model, lambda: fn(x), loss_fn, l1_coeff)
        loss.backward()
        return None
    out = fn(x)
    loss_fn(out).backward()
    return out


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# Registration and options
# ---------------------------------------------------------------------------------------------


def test_backend_is_listed():
    assert "twell" in torch._dynamo.list_backends()


def test_backend_works_without_importing_twell_compile():
    """Entry point ``torch_dynamo_backends``: a script that imports only torch can use it."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        from torch import nn
        assert "twell_compile.backend" not in sys.modules
        assert "twell" in torch._dynamo.list_backends()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 16))
        x = torch.randn(3, 16)
        out = torch.compile(model, backend="twell", options={"inner": "eager"})(x)
        torch.testing.assert_close(out, model(x))
        report = sys.modules["twell_compile.reporting"].report()
        print("REWRITTEN", len(report.rewritten))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "REWRITTEN 1" in proc.stdout, proc.stdout + proc.stderr[-2000:]


BAD_OPTIONS = [
    ({"foo": 1}, "'foo'", ["inner", "l1_coeff", "mode", "strict"]),
    ({"l1_coeff": -1}, "l1_coeff", [">= 0"]),
    ({"l1_coeff": float("nan")}, "l1_coeff", [">= 0"]),
    ({"l1_coeff": "2e-5"}, "l1_coeff", [">= 0"]),
    ({"inner": "foo"}, "inner", ["inductor", "aot_eager", "eager"]),
    ({"strict": "yes"}, "strict", ["True", "False"]),
    ({"mode": "fast"}, "mode", ["default", "reduce-overhead", "max-autotune"]),
]


@pytest.mark.parametrize("options,key,accepted", BAD_OPTIONS, ids=[str(o[0]) for o in BAD_OPTIONS])
def test_invalid_options_raise_value_error(options, key, accepted):
    with pytest.raises(ValueError) as direct:
        TwellOptions.from_dict(options)
    compiled = torch.compile(GatedFFN(D, H), backend="twell", options=options)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, D))
    err = unwrap(info.value)  # Dynamo wraps any backend error in BackendCompilerFailed
    assert isinstance(err, ValueError), repr(info.value)
    for message in (str(direct.value), str(err)):
        assert key in message, message
        for word in accepted:
            assert word in message, message


def test_valid_options_are_accepted():
    opts = TwellOptions.from_dict({"l1_coeff": 0, "inner": "aot_eager", "strict": True, "mode": "reduce-overhead"})
    assert (opts.l1_coeff, opts.inner, opts.strict, opts.mode) == (0, "aot_eager", True, "reduce-overhead")
    assert TwellOptions.from_dict(None) == TwellOptions()


def test_mode_in_options_reaches_inductor_with_other_options(monkeypatch):
    """torch.compile refuses ``mode`` together with ``options``: ``options["mode"]`` stands in, and
    acts as ``mode`` does (Inductor's mode, layers marked for CUDA graphs)."""
    from twell_compile import backend
    from twell_compile.lowering import cuda_graphs

    seen = []
    monkeypatch.setattr(backend, "compile_inner", lambda gm, inputs, inner, mode=None: seen.append(mode) or gm.forward)
    monkeypatch.setattr(cuda_graphs, "CUDA_GRAPH_LAYERS", set())
    reset_state()
    torch.compile(GatedFFN(D, H), backend="twell", options={"mode": "reduce-overhead", "l1_coeff": 1e-5})(torch.randn(2, D))
    assert seen == ["reduce-overhead"] and cuda_graphs.CUDA_GRAPH_LAYERS
    with pytest.raises(RuntimeError, match="mode or options"):  # why the option exists
        torch.compile(GatedFFN(D, H), backend="twell", mode="reduce-overhead", options={"l1_coeff": 1e-5})
    reset_state()


# ---------------------------------------------------------------------------------------------
# Inner compilers: outputs and gradients equal eager (with and without L1)
# ---------------------------------------------------------------------------------------------


def _stack():
    torch.manual_seed(0)
    return ResidualStack(D, H, n=3, kinds=("gated", "plain"))


@pytest.mark.parametrize("inner,l1", [("eager", 0.0), ("eager", 0.25), ("aot_eager", 0.0), ("aot_eager", 0.25)])
def test_inner_compilers_match_eager(inner, l1):
    model = _stack()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, D)
    compiled = torch.compile(model, backend="twell", options={"inner": inner, "l1_coeff": l1})

    out = train_step(model, compiled, x)
    assert [r.kind for r in twell_compile.report().rewritten] == ["gated", "plain", "gated"]
    assert_close(out, ref(x), rtol=1e-5, atol=1e-5, name="training output")
    train_step(ref, ref, x, l1_coeff=l1)
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)
    if l1:
        # The L1 term matters: the gradient differs from the plain loss's.
        plain = copy.deepcopy(ref)
        train_step(plain, plain, x)
        assert any(not torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-6) for p, q in zip(model.parameters(), plain.parameters()))

    with torch.no_grad():
        assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5, name="inference output")
    assert twell_compile.report().rewritten[-1].op == "twell::ffn"


def test_l1_zero_gives_plain_gradients_exactly():
    model = _stack()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4, D)
    train_step(model, torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": 0.0}), x)
    train_step(ref, ref, x)
    assert_grads_close(model, ref, rtol=1e-5, atol_frac=1e-6)


def test_l1_is_a_mean_over_the_graphs_layers():
    """Same model, one FFN vs three: the per-layer L1 weight is l1_coeff / n_layers."""
    torch.manual_seed(0)
    ffn = GatedFFN(D, H)
    x = torch.randn(4, D)
    for n in (1, 3):
        reset_state()
        model = nn.ModuleList([copy.deepcopy(ffn) for _ in range(n)])

        def fn(x, model=model):
            return sum(m(x) for m in model)

        compiled = torch.compile(fn, backend="twell", options={"inner": "aot_eager", "l1_coeff": 0.5})
        model.zero_grad()
        loss_fn(compiled(x)).backward()
        got = model[0].gate.weight.grad.clone()
        assert len(twell_compile.report().rewritten) == n
        model.zero_grad()
        eager_loss(model, lambda: fn(x), loss_fn, 0.5, modules=list(model)).backward()
        assert_close(got, model[0].gate.weight.grad, rtol=1e-4, atol=1e-6, name=f"n={n}")


def test_dynamic_batch_sizes():
    """New batch sizes recompile (then symbolically); every graph is rewritten and exact."""
    model = _stack()
    compiled = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": 0.0})
    with torch.no_grad():
        for batch in (2, 3, 5, 7):
            x = torch.randn(batch, 4, D)
            assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5, name=f"batch {batch}")
    report = twell_compile.report()
    assert len(report.rewritten) == 3 * report.graphs and not report.skipped


# ---------------------------------------------------------------------------------------------
# Property: random FFNs, rewritten (aot_eager) vs eager, outputs and every gradient
# ---------------------------------------------------------------------------------------------

EDGE_H = [1, 15, 16, 17, 40, 127, 128, 129, 200, 257]


@st.composite
def ffn_cases(draw):
    gated = draw(st.booleans())
    return dict(
        gated=gated,
        bias=tuple(draw(st.booleans()) for _ in range(3 if gated else 2)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        d=draw(st.integers(2, 24)),
        h=draw(st.one_of(st.sampled_from(EDGE_H), st.integers(1, 300))),
        lead=tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))),
        density=draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0))),
        l1=draw(st.sampled_from([0.0, 0.25])),
        seed=draw(st.integers(0, 2**16)),
    )


def _build(case):
    """An FFN module whose controlled unit (gate, or up for plain) is active with ``density``.

    Density is set the way docs/benchmarks.md ('Method') describes, which works with or without a bias: feature 0 of
    x is the constant 1 and column 0 of the controlled weight holds the normal-quantile shift.
    """
    torch.manual_seed(case["seed"])
    d, h = case["d"], case["h"]
    model = (GatedFFN if case["gated"] else PlainFFN)(d, h, bias=case["bias"])
    ctrl = model.gate if case["gated"] else model.up
    with torch.no_grad():
        w = torch.randn(h, d)
        w[:, 1:] /= w[:, 1:].norm(dim=1, keepdim=True).clamp_min(1e-6)  # z = x[:, 1:]·w ~ N(0, 1)
        p = min(max(case["density"], 1e-9), 1 - 1e-9)
        shift = math.sqrt(2) * torch.special.erfinv(torch.tensor(2 * p - 1, dtype=torch.float64)).item()
        if case["density"] in (0.0, 1.0):
            shift = 50.0 if case["density"] == 1.0 else -50.0
        w[:, 0] = shift
        ctrl.weight.copy_(w)
        if ctrl.bias is not None:
            ctrl.bias.zero_()
    x = torch.randn(*case["lead"], d)
    x[..., 0] = 1.0
    return model.to(case["dtype"]), x.to(case["dtype"])


def _rel(a, ref):
    a, ref = a.detach().double(), ref.detach().double()
    den = ref.norm().item()
    return (a - ref).norm().item() / den if den else (a - ref).norm().item()


@settings(deadline=None)
@given(case=ffn_cases())
def test_property_rewritten_equals_eager(case):
    reset_state()
    model, x = _build(case)
    ref = copy.deepcopy(model)
    x_t = x.clone().requires_grad_(True)
    compiled = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": case["l1"]})
    out = compiled(x_t)
    loss_fn(out).backward()
    assert len(twell_compile.report().rewritten) == 1, str(twell_compile.report())

    x_r = x.clone().requires_grad_(True)
    eager_loss(ref, lambda: ref(x_r), loss_fn, case["l1"]).backward()
    got = {"out": out, "dx": x_t.grad, **{f"d{n}": p.grad for n, p in model.named_parameters()}}
    want = {"out": ref(x), "dx": x_r.grad, **{f"d{n}": p.grad for n, p in ref.named_parameters()}}

    if case["dtype"] == torch.float32:
        for name, w in want.items():
            scale = float(w.detach().abs().max()) if w.numel() else 0.0
            assert_close(got[name], w, rtol=1e-4, atol=1e-5 * (1 + scale), name=name)
    else:
        # bf16: no less accurate than eager bf16, both measured against float64 eager.
        ref64 = copy.deepcopy(ref).double()
        x64 = x.double().requires_grad_(True)
        eager_loss(ref64, lambda: ref64(x64), loss_fn, case["l1"]).backward()
        want64 = {"out": ref64(x.double()), "dx": x64.grad, **{f"d{n}": p.grad for n, p in ref64.named_parameters()}}
        for name, w64 in want64.items():
            ours, eager = _rel(got[name], w64), _rel(want[name], w64)
            assert ours <= 2 * eager + 2e-2, f"{name}: twell rel. error {ours:.3g} vs eager bf16 {eager:.3g}"


# ---------------------------------------------------------------------------------------------
# set_l1_coeff: no recompile, and the gradient moves by exactly Δc · ∂L1/∂θ
# ---------------------------------------------------------------------------------------------


def _count_rewrites(monkeypatch):
    import twell_compile.backend as backend

    calls = []
    real = backend.rewrite_ffns

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "rewrite_ffns", counting)
    return calls


def test_inductor_inner_matches_eager_and_follows_set_l1_coeff(no_inductor_caches, monkeypatch):
    """The one Inductor test (slow on CPU): training grads with L1, then L1 off, one compile."""
    calls = _count_rewrites(monkeypatch)
    model = _stack()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, D)
    compiled = torch.compile(model, backend="twell", options={"inner": "inductor", "l1_coeff": 0.25})
    out = train_step(model, compiled, x)
    assert [r.kind for r in twell_compile.report().rewritten] == ["gated", "plain", "gated"]
    assert_close(out, ref(x), rtol=1e-5, atol=1e-5, name="training output")
    train_step(ref, ref, x, l1_coeff=0.25)
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5, prefix="l1=0.25: ")
    twell_compile.set_l1_coeff(0.0)
    train_step(model, compiled, x)
    train_step(ref, ref, x)
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5, prefix="l1=0: ")
    assert len(calls) == 1, "set_l1_coeff recompiled"


def test_set_l1_coeff_changes_gradient_without_recompiling(monkeypatch):
    calls = _count_rewrites(monkeypatch)
    model = _stack()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, D)
    compiled = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": 0.0})

    train_step(model, compiled, x)
    g0 = grads_of(model)
    twell_compile.set_l1_coeff(0.5)
    train_step(model, compiled, x)
    g1 = grads_of(model)
    twell_compile.set_l1_coeff(0.125)
    train_step(model, compiled, x)
    g2 = grads_of(model)

    assert len(calls) == 1 and twell_compile.report().graphs == 1, "set_l1_coeff recompiled"
    # Expected change: Δc · ∂L1/∂θ, from eager autograd of the L1 term alone.
    ref.zero_grad()
    eager_loss(ref, lambda: ref(x), lambda out: out.sum() * 0, 1.0).backward()
    dl1 = grads_of(ref)
    for name in g0:
        scale = float(dl1[name].abs().max())
        assert_close(g1[name] - g0[name], 0.5 * dl1[name], rtol=1e-3, atol=1e-5 * (1 + scale), name=f"Δ(0→0.5) {name}")
        assert_close(g2[name] - g0[name], 0.125 * dl1[name], rtol=1e-3, atol=1e-5 * (1 + scale), name=f"Δ(0→0.125) {name}")
    assert any(dl1[n].abs().max() > 0 for n in dl1)


def test_set_l1_coeff_reaches_graphs_compiled_later(monkeypatch):
    """A schedule's current value must survive a recompile (here: a new batch shape)."""
    model = _stack()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": 0.0}, dynamic=False)
    train_step(model, compiled, torch.randn(2, 5, D))
    twell_compile.set_l1_coeff(0.5)
    x = torch.randn(3, 5, D)  # recompiles
    train_step(model, compiled, x)
    assert twell_compile.report().graphs == 2
    train_step(ref, ref, x, l1_coeff=0.5)
    assert_grads_close(model, ref, rtol=1e-4, atol_frac=1e-5)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "0.1"])
def test_set_l1_coeff_rejects_invalid_values(value):
    with pytest.raises(ValueError, match="set_l1_coeff"):
        twell_compile.set_l1_coeff(value)


# ---------------------------------------------------------------------------------------------
# report() and stats()
# ---------------------------------------------------------------------------------------------


def test_report_prints_a_table_naming_layers():
    model = _stack()
    torch.compile(model, backend="twell", options={"inner": "eager"})(torch.randn(2, D))
    report = twell_compile.report()
    assert [r.where for r in report.rewritten] == ["layers.0", "layers.1", "layers.2"]
    assert [r.biases for r in report.rewritten] == ["gate,up,down", "up,down", "gate,up,down"]
    text = str(report)
    assert text.splitlines()[0] == "twell: rewrote 3 FFN(s), skipped 0, in 1 graph(s)"
    for word in ("layer", "where", "kind", "biases", "dtype", "op", "layers.0", "layers.1", "layers.2", "gated", "plain", "twell::ffn_train"):
        assert word in text, text
    assert repr(report) == text
    twell_compile.reset()
    assert not twell_compile.report().rewritten and twell_compile.report().graphs == 0


def test_stats_after_a_training_step():
    model = _stack()
    x = torch.randn(3, 4, D)
    compiled = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": 0.1})
    train_step(model, compiled, x)

    # Manual counts from the eager model on the same input.
    layers = ffn_modules(model)
    controlled, hiddens = [], []

    def record(mod, args, out):
        controlled.append((mod.gate if isinstance(mod, GatedFFN) else mod.up)(args[0]).detach())
        hiddens.append(mod.hidden(args[0]).detach())

    handles = [m.register_forward_hook(record) for m in layers]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()

    stats = twell_compile.stats()
    report = twell_compile.report()
    assert [s.layer for s in stats.layers] == [r.layer for r in report.rewritten]
    assert [s.where for s in stats.layers] == ["layers.0", "layers.1", "layers.2"]
    tokens = 12
    for s, pre, h in zip(stats.layers, controlled, hiddens):
        assert s.calls == 1 and s.tokens == tokens
        assert s.l0 == pytest.approx(int((pre > 0).sum()) / tokens)
        assert s.l1 == pytest.approx(h.abs().sum().item() / tokens, rel=1e-5)
        assert s.path in ("sparse", "dense") and 0 <= s.dense_rows <= tokens
    assert stats.l0 == pytest.approx(sum(s.l0 for s in stats.layers) / 3)
    assert stats.l1 == pytest.approx(sum(h.abs().sum().item() / tokens for h in hiddens) / 3, rel=1e-5)
    text = str(stats)
    assert "layers.1" in text and "L0" in text and "L1" in text

    train_l1 = stats.l1
    with torch.no_grad():  # a new (inference) graph of the same layers: the same rows, one call more
        compiled(x)
    stats = twell_compile.stats()
    assert [s.where for s in stats.layers] == ["layers.0", "layers.1", "layers.2"]
    assert [s.calls for s in stats.layers] == [2, 2, 2]
    assert stats.l1 == pytest.approx(train_l1)  # an inference call keeps the last training call's L1

    twell_compile.reset()
    assert twell_compile.stats().layers == [] and twell_compile.stats().l0 is None
    assert "no rewritten layer" in str(twell_compile.stats())


@pytest.mark.parametrize("mode,graphs", [(None, False), ("default", False), ("reduce-overhead", True),
                                         ("max-autotune", True), ("max-autotune-no-cudagraphs", False)])
def test_modes_with_cuda_graphs_are_recognised(mode, graphs):
    from twell_compile.backend import uses_cuda_graphs

    assert uses_cuda_graphs(mode) is graphs


def test_layers_compiled_for_cuda_graphs_keep_no_activations_between_forward_and_backward(monkeypatch):
    """Under cudagraph trees the forward's warm-up runs in the graphs' memory pool, where a tensor
    kept past the op (the dense path's hand-off to its backward) is an error: such layers are
    marked at compile time, and the op then keeps nothing for them."""
    from twell_compile.lowering import cuda_graphs
    from twell_compile.lowering.handoff import HANDOFF, remember, take_saved
    from twell_compile.options import TwellOptions
    from twell_compile.rewrite_ffn import rewrite_ffns

    monkeypatch.setattr(cuda_graphs, "CUDA_GRAPH_LAYERS", set())
    reset_state()
    torch.compile(GatedFFN(D, H), backend="twell", options={"inner": "eager"})(torch.randn(2, D))
    assert cuda_graphs.CUDA_GRAPH_LAYERS == set()  # no graphs: nothing marked

    def graphs_backend(gm, example_inputs):
        rewritten, _ = rewrite_ffns(gm, TwellOptions(), cuda_graphs=True)
        assert rewritten
        assert cuda_graphs.CUDA_GRAPH_LAYERS == {r.layer for r in rewritten}
        return gm.forward

    torch.compile(GatedFFN(D, H), backend=graphs_backend)(torch.randn(2, D))
    assert cuda_graphs.CUDA_GRAPH_LAYERS
    count = torch.zeros(4, dtype=torch.int32)
    saved = (torch.ones(1),) * 3
    remember(count, True, saved, next(iter(cuda_graphs.CUDA_GRAPH_LAYERS)))
    assert count.data_ptr() not in HANDOFF
    remember(count, True, saved, -1)  # an unmarked layer keeps them
    assert take_saved(count.data_ptr(), dense=True) is saved
    reset_state()
