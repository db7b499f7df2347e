"""The FFN matcher and rewrite (docs/architecture.md, 'The matcher'), driven through ``torch.compile(backend="twell")``.

Every spelling the design accepts must be rewritten (counted by ``report()``), with outputs equal
to eager. Near misses must be left alone and listed in ``report().skipped`` with the right
``SkipReason``; ``strict=True`` turns them into ``TwellRewriteError``.

All compiles here use ``inner="eager"`` (rewrite only) to keep the suite fast; the inner compilers
are covered in ``test_backend.py``.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import twell_compile
from twell_compile import SkipReason, TwellRewriteError

from tests.ffn_models import GatedFFN, PlainFFN, assert_close, reset_state, unwrap

D, H = 16, 40


@pytest.fixture(autouse=True)
def _fresh():
    reset_state()
    yield
    reset_state()


class Spelled(nn.Module):
    """FFN weights as bare parameters, with the forward given as a function of ``(self, x)``."""

    def __init__(self, forward: Callable, *, gated: bool = True, bias: bool = True, act: Optional[nn.Module] = None):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def param(*shape, scale):
            return nn.Parameter(scale * torch.randn(*shape, generator=g))

        self.wg = param(H, D, scale=D**-0.5) if gated else None
        self.wu = param(H, D, scale=D**-0.5)
        self.wd = param(D, H, scale=H**-0.5)
        self.bg = param(H, scale=0.1) if gated and bias else None
        self.bu = param(H, scale=0.1) if bias else None
        self.bd = param(D, scale=0.1) if bias else None
        self.act = act
        self._forward = forward

    def forward(self, x):
        return self._forward(self, x)


def run_twell(fn, *inputs, rtol=1e-5, atol=1e-6, **options):
    """Compile ``fn`` with the twell backend, check its outputs against eager, return the report."""
    options.setdefault("inner", "eager")
    compiled = torch.compile(fn, backend="twell", options=options)
    got = compiled(*inputs)
    want = fn(*inputs)
    got_t = got if isinstance(got, tuple) else (got,)
    want_t = want if isinstance(want, tuple) else (want,)
    for i, (a, e) in enumerate(zip(got_t, want_t)):
        assert a.dtype == e.dtype and a.shape == e.shape, f"output {i}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        scale = float(e.detach().abs().max()) if e.numel() else 0.0
        assert_close(a, e, rtol=rtol, atol=atol * (1 + scale), name=f"output {i}")
    return twell_compile.report()


def assert_rewritten(report, n: int, *, kind: Optional[str] = None, biases: Optional[str] = None, dtype: str = "float32"):
    assert len(report.rewritten) == n, f"expected {n} rewrite(s):\n{report}"
    assert not report.skipped, f"unexpected skips:\n{report}"
    for r in report.rewritten:
        assert kind is None or r.kind == kind, str(report)
        assert biases is None or r.biases == biases, str(report)
        assert r.dtype == dtype, str(report)


def assert_skipped(report, reason: SkipReason):
    assert not report.rewritten, f"a near miss was rewritten:\n{report}"
    assert [s.reason for s in report.skipped] == [reason], f"expected one skip for {reason.name}:\n{report}"
    assert reason.text in str(report)


# ---------------------------------------------------------------------------------------------
# Spellings (docs/architecture.md, 'The matcher')
# ---------------------------------------------------------------------------------------------

PROJECTION_SPELLINGS = {
    "F.linear": lambda s, x: F.linear(F.relu(F.linear(x, s.wg, s.bg)) * F.linear(x, s.wu, s.bu), s.wd, s.bd),
    "x@W.T+b": lambda s, x: (F.relu(x @ s.wg.T + s.bg) * (x @ s.wu.T + s.bu)) @ s.wd.T + s.bd,
    "b+x@W.T": lambda s, x: s.bd + (F.relu(s.bg + x @ s.wg.T) * (s.bu + x @ s.wu.T)) @ s.wd.T,
    "torch.add(x@W.T,b)": lambda s, x: torch.add(torch.relu(torch.add(x @ s.wg.T, s.bg)) * torch.add(x @ s.wu.T, s.bu) @ s.wd.T, s.bd),
    "matmul(x,W.t())+b": lambda s, x: torch.matmul(torch.relu(torch.matmul(x, s.wg.t()) + s.bg) * (torch.matmul(x, s.wu.t()) + s.bu), s.wd.t()) + s.bd,
    "W.transpose(0,1)": lambda s, x: (F.relu(x @ s.wg.transpose(0, 1) + s.bg) * (x @ s.wu.transpose(0, 1) + s.bu)) @ s.wd.transpose(0, 1) + s.bd,
    "torch.transpose(W,-1,-2)": lambda s, x: (F.relu(x @ torch.transpose(s.wg, -1, -2) + s.bg) * (x @ torch.transpose(s.wu, -1, -2) + s.bu)) @ torch.transpose(s.wd, -1, -2) + s.bd,
    "torch.t(W),W.mT": lambda s, x: (F.relu(x @ torch.t(s.wg) + s.bg) * (x @ s.wu.mT + s.bu)) @ s.wd.mT + s.bd,
    "x.matmul(W.T)": lambda s, x: (F.relu(x.matmul(s.wg.T) + s.bg) * (x.matmul(s.wu.T) + s.bu)).matmul(s.wd.T) + s.bd,
}


@pytest.mark.parametrize("spelling", list(PROJECTION_SPELLINGS))
def test_projection_spellings_gated(spelling):
    model = Spelled(PROJECTION_SPELLINGS[spelling])
    report = run_twell(model, torch.randn(2, 5, D))
    assert_rewritten(report, 1, kind="gated")
    # The gate and up biases go into the op; a down bias added after ``h @ Wd.T`` may stay an add.
    assert report.rewritten[0].biases in ("gate,up,down", "gate,up"), str(report)


PLAIN_SPELLINGS = {
    "F.linear": lambda s, x: F.linear(F.relu(F.linear(x, s.wu, s.bu)), s.wd, s.bd),
    "x@W.T+b": lambda s, x: torch.relu(x @ s.wu.T + s.bu) @ s.wd.T + s.bd,
    "matmul(x,W.t())": lambda s, x: torch.matmul(torch.relu(torch.matmul(x, s.wu.t()) + s.bu), s.wd.t()) + s.bd,
}


@pytest.mark.parametrize("spelling", list(PLAIN_SPELLINGS))
def test_projection_spellings_plain(spelling):
    model = Spelled(PLAIN_SPELLINGS[spelling], gated=False)
    report = run_twell(model, torch.randn(2, 5, D))
    assert_rewritten(report, 1, kind="plain")
    assert report.rewritten[0].biases in ("up,down", "up"), str(report)


RELU_SPELLINGS = {
    "F.relu": lambda s, g: F.relu(g),
    "torch.relu": lambda s, g: torch.relu(g),
    "x.relu()": lambda s, g: g.relu(),
    "nn.ReLU()": lambda s, g: s.act(g),
    "nn.ReLU(inplace=True)": lambda s, g: s.act(g),
    "F.relu(inplace=True)": lambda s, g: F.relu(g, inplace=True),
    "torch.relu_": lambda s, g: torch.relu_(g),
    "x.relu_()": lambda s, g: g.relu_(),
}


def _act_module(spelling):
    return {"nn.ReLU()": nn.ReLU(), "nn.ReLU(inplace=True)": nn.ReLU(inplace=True)}.get(spelling)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("spelling", list(RELU_SPELLINGS))
def test_relu_spellings(spelling, gated):
    relu = RELU_SPELLINGS[spelling]
    if gated:
        fwd = lambda s, x: F.linear(relu(s, F.linear(x, s.wg, s.bg)) * F.linear(x, s.wu, s.bu), s.wd, s.bd)  # noqa: E731
    else:
        fwd = lambda s, x: F.linear(relu(s, F.linear(x, s.wu, s.bu)), s.wd, s.bd)  # noqa: E731
    model = Spelled(fwd, gated=gated, act=_act_module(spelling))
    report = run_twell(model, torch.randn(3, D))
    assert_rewritten(report, 1, kind="gated" if gated else "plain")


MUL_SPELLINGS = {
    "act*up": lambda a, u: a * u,
    "up*act": lambda a, u: u * a,
    "torch.mul(act,up)": lambda a, u: torch.mul(a, u),
    "torch.mul(up,act)": lambda a, u: torch.mul(u, a),
    "act.mul(up)": lambda a, u: a.mul(u),
    "operator.mul(up,act)": lambda a, u: operator.mul(u, a),
}


@pytest.mark.parametrize("spelling", list(MUL_SPELLINGS))
def test_mul_operand_order_and_spelling(spelling):
    mul = MUL_SPELLINGS[spelling]
    model = Spelled(lambda s, x: F.linear(mul(F.relu(F.linear(x, s.wg, s.bg)), F.linear(x, s.wu, s.bu)), s.wd, s.bd))
    assert_rewritten(run_twell(model, torch.randn(3, D)), 1, kind="gated")


GATED_BIASES = {"gate,up,down": (True, True, True), "none": (False, False, False), "gate": (True, False, False),
                "up": (False, True, False), "down": (False, False, True), "gate,up": (True, True, False)}
PLAIN_BIASES = {"up,down": (True, True), "none": (False, False), "up": (True, False), "down": (False, True)}


@pytest.mark.parametrize("biases", list(GATED_BIASES))
def test_nn_linear_gated_each_bias(biases):
    torch.manual_seed(0)
    report = run_twell(GatedFFN(D, H, bias=GATED_BIASES[biases]), torch.randn(2, 3, D))
    assert_rewritten(report, 1, kind="gated", biases=biases)
    assert report.rewritten[0].op == "twell::ffn_train"  # parameters require grad, grad mode on


@pytest.mark.parametrize("biases", list(PLAIN_BIASES))
def test_nn_linear_plain_each_bias(biases):
    torch.manual_seed(0)
    report = run_twell(PlainFFN(D, H, bias=PLAIN_BIASES[biases]), torch.randn(2, 3, D))
    assert_rewritten(report, 1, kind="plain", biases=biases)


def test_nn_sequential_with_relu_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(inplace=True), nn.Linear(H, D))
    assert_rewritten(run_twell(model, torch.randn(4, D)), 1, kind="plain", biases="up,down")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("shape", [(7, D), (2, 5, D), (2, 3, 4, D)], ids=["2d", "3d", "4d"])
def test_input_ranks(shape, gated):
    torch.manual_seed(0)
    model = GatedFFN(D, H) if gated else PlainFFN(D, H)
    assert_rewritten(run_twell(model, torch.randn(*shape)), 1)


def test_inference_op_under_no_grad():
    torch.manual_seed(0)
    model = GatedFFN(D, H)
    with torch.no_grad():
        report = run_twell(model, torch.randn(3, D))
    assert_rewritten(report, 1)
    assert report.rewritten[0].op == "twell::ffn"


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_dtypes(dtype, gated):
    torch.manual_seed(0)
    model = (GatedFFN(D, H) if gated else PlainFFN(D, H)).to(dtype)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    report = run_twell(model, torch.randn(2, 3, D, dtype=dtype), rtol=tol, atol=tol)
    assert_rewritten(report, 1, dtype=str(dtype)[6:])


# --- autocast ----------------------------------------------------------------------------------


class AutocastInside(nn.Module):
    def __init__(self, ffn):
        super().__init__()
        self.ffn = ffn

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.ffn(x)


@pytest.mark.parametrize("inner", ["aot_eager", "eager"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_autocast_inside_compiled_fn(gated, inner):
    # With inner="eager" the graph's autocast region is live while the op runs (as for patch()).
    torch.manual_seed(0)
    model = AutocastInside(GatedFFN(D, H) if gated else PlainFFN(D, H))
    report = run_twell(model, torch.randn(2, 3, D), rtol=2e-2, atol=2e-2, inner=inner)
    assert_rewritten(report, 1, dtype="bfloat16")


@pytest.mark.parametrize("inner", ["aot_eager", "eager"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_autocast_ambient(train, inner):
    torch.manual_seed(0)
    model = GatedFFN(D, H)
    x = torch.randn(2, 3, D)
    with torch.set_grad_enabled(train), torch.autocast("cpu", dtype=torch.bfloat16):
        report = run_twell(model, x, rtol=2e-2, atol=2e-2, inner=inner)
    assert_rewritten(report, 1, dtype="bfloat16")
    assert report.rewritten[0].op == ("twell::ffn_train" if train else "twell::ffn")


def test_autocast_training_gradients_match_eager():
    torch.manual_seed(0)
    model = GatedFFN(D, H)
    x = torch.randn(4, 6, D)
    compiled = torch.compile(model, backend="twell", options={"inner": "aot_eager", "l1_coeff": 0.0})
    grads = {}
    for name, fn in (("twell", compiled), ("eager", model)):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x)
        out.float().square().sum().backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_rewritten(twell_compile.report(), 1, dtype="bfloat16")
    for n, g in grads["eager"].items():
        assert grads["twell"][n].dtype == torch.float32  # master weights keep their dtype
        assert_close(grads["twell"][n], g, rtol=3e-2, atol=3e-2 * float(g.abs().max()), name=n)


def test_autocast_compile_logs_no_errors(capfd, caplog):
    """The rewrite must not make FakeTensor log errors (the op's fake impl called with x=None)."""
    torch.manual_seed(0)
    model = GatedFFN(D, H)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(model, backend="twell", options={"inner": "aot_eager"})(torch.randn(3, D))
    assert len(twell_compile.report().rewritten) == 1
    err = capfd.readouterr().err
    assert "fake tensor raised" not in err and "Traceback" not in err, err[-3000:]
    errors = [r for r in caplog.records if r.levelno >= 40]
    assert not errors, "\n".join(r.getMessage() for r in errors)


def test_rewritten_nodes_carry_example_values(monkeypatch):
    """New nodes get fake ``example_value`` meta, as the rewrite promises later passes."""
    import twell_compile.backend as backend

    seen = []
    real_compile_inner = backend.compile_inner

    def spy(gm, example_inputs, inner, mode=None):
        seen.append(gm)
        return real_compile_inner(gm, example_inputs, inner, mode)

    monkeypatch.setattr(backend, "compile_inner", spy)
    torch.manual_seed(0)
    run_twell(GatedFFN(D, H), torch.randn(2, 3, D))
    (gm,) = seen
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.twell.ffn_train.default]
    assert len(ops) == 1
    (getitem,) = ops[0].users
    value = getitem.meta.get("example_value")
    assert isinstance(value, torch.Tensor) and tuple(value.shape) == (2, 3, D), f"no example_value on {getitem.name}: {getitem.meta}"
    assert "example_value" in ops[0].meta


def test_rewritten_graph_has_no_dense_ffn_left(monkeypatch):
    import twell_compile.backend as backend

    seen = []
    real_compile_inner = backend.compile_inner
    monkeypatch.setattr(backend, "compile_inner", lambda gm, ex, inner, mode=None: (seen.append(gm), real_compile_inner(gm, ex, inner, mode))[1])
    torch.manual_seed(0)
    with torch.no_grad():
        run_twell(nn.Sequential(GatedFFN(D, H), nn.LayerNorm(D), PlainFFN(D, H)), torch.randn(3, D))
    (gm,) = seen
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.twell.ffn.default) == 2
    assert not [t for t in targets if t in (torch._C._nn.linear, F.linear, torch.relu, F.relu, operator.mul)], targets


def test_several_ffns_in_one_graph_get_distinct_layers():
    torch.manual_seed(0)
    model = nn.Sequential(GatedFFN(D, H), nn.LayerNorm(D), PlainFFN(D, H), nn.Tanh(), GatedFFN(D, H, bias=False))
    report = run_twell(model, torch.randn(2, 3, D))
    assert [r.kind for r in report.rewritten] == ["gated", "plain", "gated"]
    assert len({r.layer for r in report.rewritten}) == 3
    assert [r.where for r in report.rewritten] == ["0", "2", "4"]  # the FFN modules' paths


def test_back_to_back_ffns():
    """One FFN's output is the next one's input (no residual in between)."""
    torch.manual_seed(0)
    model = nn.Sequential(PlainFFN(D, H), GatedFFN(D, H))
    assert_rewritten(run_twell(model, torch.randn(2, 3, D)), 2)


def test_overlapping_relu_mlp_chain_never_crashes():
    """Linear-ReLU-Linear-ReLU-Linear with alternating widths: the middle Linear is the down
    projection of one FFN and the up projection of the next. Overlapping matches may not both be
    rewritten, but the compile must succeed (the matcher is total) with eager outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D), nn.ReLU(), nn.Linear(D, H))
    report = run_twell(model, torch.randn(3, D))
    assert len(report.rewritten) >= 1, str(report)


# ---------------------------------------------------------------------------------------------
# Near misses (must NOT be rewritten; docs/architecture.md, 'The matcher')
# ---------------------------------------------------------------------------------------------


def _gated(x, s, *, gate=None, up_x=None):
    gate = F.linear(x, s.wg, s.bg) if gate is None else gate
    return F.relu(gate) * F.linear(x if up_x is None else up_x, s.wu, s.bu)


NEAR_MISSES = {
    # gate (pre-activation) also returned
    "gate-returned": (lambda s, x: (lambda g: (F.linear(F.relu(g) * F.linear(x, s.wu, s.bu), s.wd, s.bd), g))(F.linear(x, s.wg, s.bg)), SkipReason.MULTI_USER),
    # relu(gate) also added to the loss
    "act-used-twice": (lambda s, x: (lambda a: F.linear(a * F.linear(x, s.wu, s.bu), s.wd, s.bd).sum() + a.abs().sum())(F.relu(F.linear(x, s.wg, s.bg))), SkipReason.MULTI_USER),
    # hidden h also used (e.g. an explicit L1 term)
    "hidden-used-twice": (lambda s, x: (lambda h: F.linear(h, s.wd, s.bd).sum() + 1e-3 * h.abs().sum())(_gated(x, s)), SkipReason.MULTI_USER),
    # up projection also returned
    "up-returned": (lambda s, x: (lambda u: (F.linear(F.relu(F.linear(x, s.wg, s.bg)) * u, s.wd, s.bd), u))(F.linear(x, s.wu, s.bu)), SkipReason.MULTI_USER),
    # x @ W.T (before the bias add) used elsewhere
    "matmul-before-bias-used-twice": (lambda s, x: (lambda m: (F.linear(F.relu(m + s.bg) * F.linear(x, s.wu, s.bu), s.wd, s.bd), m))(x @ s.wg.T), SkipReason.MULTI_USER),
    # gate and up read different inputs
    "different-inputs": (lambda s, x: F.linear(_gated(x, s, up_x=2 * x), s.wd, s.bd), SkipReason.NOT_AN_UP_PROJECTION),
    # relu(linear) * a non-linear value
    "times-sigmoid": (lambda s, x: F.linear(F.relu(F.linear(x, s.wg, s.bg)) * torch.sigmoid(F.linear(x, s.wu, s.bu)), s.wd, s.bd), SkipReason.NOT_AN_UP_PROJECTION),
    "times-input": (lambda s, x: F.linear(F.relu(F.linear(x, s.wg, s.bg)) * x.sum(-1, keepdim=True), s.wd, s.bd), SkipReason.NOT_AN_UP_PROJECTION),
    # relu(linear) feeding no linear
    "relu-then-sum": (lambda s, x: F.relu(F.linear(x, s.wu, s.bu)).sum(-1), SkipReason.NO_DOWN_PROJECTION),
    "gated-then-softmax": (lambda s, x: torch.softmax(_gated(x, s), -1), SkipReason.NO_DOWN_PROJECTION),
    # the down projection is not in nn.Linear layout (x @ W, no transpose): not a down projection
    "down-not-transposed": (lambda s, x: _gated(x, s) @ s.wd.T.contiguous(), SkipReason.NO_DOWN_PROJECTION),
    # a down projection to another width: not one FFN
    "down-to-other-width": (lambda s, x: F.linear(F.relu(F.linear(x, s.wu, s.bu)), torch.ones(D + 8, H)), SkipReason.SHAPE_MISMATCH),
    # a broadcast bias of shape [1]
    "broadcast-bias": (lambda s, x: F.linear(F.relu(F.linear(x, s.wu) + s.bu[:1]), s.wd), SkipReason.SHAPE_MISMATCH),
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_near_miss_is_skipped_with_reason(case):
    fwd, reason = NEAR_MISSES[case]
    model = Spelled(fwd)
    assert_skipped(run_twell(model, torch.randn(2, 3, D)), reason)


def test_mixed_dtypes_under_autocast_is_skipped():
    """Up computed with autocast disabled (fp32) while the gate runs in bf16."""

    def fwd(s, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            g = F.linear(x, s.wg, s.bg)
            with torch.autocast("cpu", enabled=False):
                u = F.linear(x, s.wu, s.bu)
            return F.linear(F.relu(g) * u, s.wd, s.bd)

    assert_skipped(run_twell(Spelled(fwd), torch.randn(3, D), rtol=1e-2, atol=1e-2), SkipReason.MIXED_DTYPES)


def test_float64_is_skipped_as_unsupported_dtype():
    torch.manual_seed(0)
    assert_skipped(run_twell(GatedFFN(D, H).double(), torch.randn(3, D, dtype=torch.float64)), SkipReason.UNSUPPORTED_DTYPE)


def test_batched_3d_weight_via_bmm_is_not_matched():
    wu, wd = torch.randn(2, H, D), torch.randn(2, D, H)

    def fn(x):
        return torch.bmm(torch.relu(torch.bmm(x, wu.transpose(1, 2))), wd.transpose(1, 2))

    report = run_twell(fn, torch.randn(2, 3, D))
    assert not report.rewritten and not report.skipped


def test_graph_without_ffn_records_nothing():
    report = run_twell(lambda x: torch.sigmoid(x @ x.T).sum(-1), torch.randn(4, D))
    assert report.rewritten == [] and report.skipped == []
    assert report.graphs == 1


def test_one_ffn_rewritten_next_to_a_near_miss():
    torch.manual_seed(0)
    ffn = GatedFFN(D, H)
    near = Spelled(NEAR_MISSES["hidden-used-twice"][0])
    report = run_twell(lambda x: ffn(x).sum() + near(x), torch.randn(3, D))
    assert len(report.rewritten) == 1 and [s.reason for s in report.skipped] == [SkipReason.MULTI_USER]
    text = str(report)
    assert "rewrote 1" in text and "skipped 1" in text and SkipReason.MULTI_USER.text in text


def test_matcher_failure_never_crashes_a_compile(monkeypatch):
    import twell_compile.match_ffn as match_ffn

    def boom(node, gm=None):
        raise RuntimeError("matcher exploded")

    monkeypatch.setattr(match_ffn, "match_at_relu", boom)
    torch.manual_seed(0)
    report = run_twell(GatedFFN(D, H), torch.randn(3, D))
    assert not report.rewritten
    assert [s.reason for s in report.skipped] == [SkipReason.INTERNAL_ERROR]
    assert "matcher exploded" in report.skipped[0].detail


# ---------------------------------------------------------------------------------------------
# strict=True
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["hidden-used-twice", "different-inputs", "relu-then-sum"])
def test_strict_raises_naming_the_reason(case):
    fwd, reason = NEAR_MISSES[case]
    compiled = torch.compile(Spelled(fwd), backend="twell", options={"inner": "eager", "strict": True})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3, D))
    err = unwrap(info.value)  # Dynamo wraps backend errors in BackendCompilerFailed
    assert isinstance(err, TwellRewriteError), repr(info.value)
    assert reason.text in str(err)
    assert [s.reason for s in twell_compile.report().skipped] == [reason]


def test_strict_on_a_clean_model_does_not_raise():
    torch.manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(GatedFFN(D, H), nn.LayerNorm(D), PlainFFN(D, H))
    assert_rewritten(run_twell(model, torch.randn(2, 3, D), strict=True), 2)
