"""The TwELL ops ``twell::ffn``, ``twell::ffn_train`` and ``twell::ffn_bwd`` on CPU.

* ``torch.library.opcheck`` (schema, fake impl, autograd registration, AOT dispatch with dynamic
  shapes) for gated/plain, with/without biases, fp32/fp16/bf16, 2-D and 3-D ``x``;
* argument checks: ``ValueError`` naming the argument at fault;
* telemetry written by a call (calls, tokens, active neurons, L1);
* gradients: ``ffn`` under autograd is exact (no L1); ``ffn_train`` adds exactly
  ``l1_coeff · l1_factor · ∂L1/∂θ`` with ``L1 = (1/T) Σ|h|`` (docs/architecture.md, 'The L1
  regularizer'), ``l1_factor`` read when the backward runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import twell_compile.lowering  # noqa: F401  (registers torch.ops.twell.*)
from twell_compile.lowering import telemetry
from twell_compile.lowering.checks import check_ffn_args

from tests.ffn_models import assert_close

ops = torch.ops.twell
D, H = 8, 20  # H fits no tile (128) on purpose


@pytest.fixture(autouse=True)
def _fresh_telemetry():
    telemetry.reset()
    yield
    telemetry.reset()


def make_args(gated: bool, bias: bool, dtype=torch.float32, lead=(6,), *, requires_grad=False, d=D, h=H, seed=0):
    """``(x, wg, wu, wd, bg, bu, bd)`` in ``nn.Linear`` layouts; about half the gate is active."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(requires_grad)

    x = rand(*lead, d)
    wg = rand(h, d, scale=d**-0.5) if gated else None
    wu = rand(h, d, scale=d**-0.5)
    wd = rand(d, h, scale=h**-0.5)
    bg = rand(h, scale=0.1) if gated and bias else None
    bu = rand(h, scale=0.1) if bias else None
    bd = rand(d, scale=0.1) if bias else None
    return x, wg, wu, wd, bg, bu, bd


def detached(args):
    return tuple(None if t is None else t.detach() for t in args)


def dense_hidden(x, wg, wu, bg, bu):
    up = F.linear(x, wu, bu)
    return torch.relu(up) if wg is None else torch.relu(F.linear(x, wg, bg)) * up


def dense_ffn(x, wg, wu, wd, bg, bu, bd):
    return F.linear(dense_hidden(x, wg, wu, bg, bu), wd, bd)


# ---------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------

# Every gated/plain × bias combination in fp32 with 2-D and 3-D x; fp16 and bf16 on every
# gated/plain × bias combination with one rank each (rank and dtype do not interact in the ops,
# and the AOT-dispatch check costs ~0.6 s per op and case).
OPCHECK_CASES = [
    *itertools.product([True, False], [True, False], [torch.float32], [(6,), (2, 3)]),
    *itertools.product([True, False], [True, False], [torch.float16], [(6,)]),
    *itertools.product([True, False], [True, False], [torch.bfloat16], [(2, 3)]),
]


def _case_id(case):
    gated, bias, dtype, lead = case
    return f"{'gated' if gated else 'plain'}-{'bias' if bias else 'nobias'}-{str(dtype)[6:]}-{len(lead) + 1}d"


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=[_case_id(c) for c in OPCHECK_CASES])
def test_opcheck_all_ops(case):
    gated, bias, dtype, lead = case
    args = make_args(gated, bias, dtype, lead, requires_grad=True)
    coeff = torch.tensor(0.25)
    torch.library.opcheck(ops.ffn.default, (*args, 0))
    factor = torch.tensor(0.5)
    torch.library.opcheck(ops.ffn_train.default, (*args, coeff, factor, 0))
    plain_args = detached(args)
    with torch.no_grad():
        out, idx, val, count, up_val = ops.ffn_train(*plain_args, coeff, factor, 0)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.ffn_bwd.default, (dout, *plain_args, idx, val, count, up_val, coeff, factor, 0))


def test_l1_snapshot_is_a_copy_that_later_writes_do_not_change():
    live = torch.tensor(0.25)
    torch.library.opcheck(ops.l1_snapshot.default, (live,))
    snapshot = ops.l1_snapshot(live)
    live.fill_(1.0)
    assert snapshot.item() == 0.25 and snapshot.data_ptr() != live.data_ptr()


def test_fake_impls_match_real_shapes_and_dtypes():
    """The saved TwELL tensors have shapes from input shapes only (fixed capacity: docs/format.md,
    'Layout')."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for gated in (True, False):
        args = make_args(gated, True, torch.bfloat16, (2, 3), h=300)
        real = ops.ffn_train(*args, torch.tensor(0.0), torch.tensor(1.0), 0)
        with FakeTensorMode() as mode:
            fake_args = tuple(None if t is None else mode.from_tensor(t) for t in args)
            fake = ops.ffn_train(*fake_args, mode.from_tensor(torch.tensor(0.0)), torch.tensor(1.0), 0)
        for r, f in zip(real, fake):
            assert (tuple(r.shape), r.dtype) == (tuple(f.shape), f.dtype)
        assert real[1].shape[-2:] == (3, 16)  # ceil(300 / 128) tiles of 16 slots


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------


def _bad_args(kind):
    x, wg, wu, wd, bg, bu, bd = make_args(True, True, torch.float32, (2, 3))
    return {
        "x-features": ((torch.randn(2, 3, D + 1), wg, wu, wd, bg, bu, bd), r"\bx\b.*features"),
        "x-0d": ((torch.tensor(1.0), wg, wu, wd, bg, bu, bd), r"\bx\b.*dimension"),
        "x-int": ((x.long(), wg, wu, wd, bg, bu, bd), r"\bx\b.*dtype.*int64"),
        "wg-shape": ((x, torch.randn(H + 1, D), wu, wd, bg, bu, bd), r"\bwg\b.*shape"),
        "wu-3d": ((x, wg, wu[None], wd, bg, bu, bd), r"\bwu\b"),
        "wd-transposed": ((x, wg, wu, wd.T.contiguous(), bg, bu, bd), r"\bwd\b.*shape"),
        "bg-shape": ((x, wg, wu, wd, torch.randn(3), bu, bd), r"\bbg\b.*shape"),
        "bu-shape": ((x, wg, wu, wd, bg, torch.randn(D), bd), r"\bbu\b.*shape"),
        "bd-shape": ((x, wg, wu, wd, bg, bu, torch.randn(H)), r"\bbd\b.*shape"),
        "wg-dtype": ((x, wg.double(), wu, wd, bg, bu, bd), r"\bwg\b.*dtype"),
        "wu-dtype": ((x, wg, wu.half(), wd, bg, bu, bd), r"\bwu\b.*float16"),
        "bd-dtype": ((x, wg, wu, wd, bg, bu, bd.bfloat16()), r"\bbd\b.*dtype"),
        "bg-without-wg": ((x, None, wu, wd, bg, bu, bd), r"\bbg\b.*\bwg\b"),
    }[kind]


BAD_KINDS = ["x-features", "x-0d", "x-int", "wg-shape", "wu-3d", "wd-transposed", "bg-shape", "bu-shape", "bd-shape",
             "wg-dtype", "wu-dtype", "bd-dtype", "bg-without-wg"]


@pytest.mark.parametrize("op", ["ffn", "ffn_train"])
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_arguments_raise_value_error_naming_them(op, kind):
    args, pattern = _bad_args(kind)
    with pytest.raises(ValueError, match=pattern):
        if op == "ffn":
            ops.ffn(*args, 0)
        else:
            ops.ffn_train(*args, torch.tensor(0.0), torch.tensor(1.0), 0)


@pytest.mark.parametrize("name", ["wg", "wd", "bu", "bd"])
def test_device_mismatch_names_the_argument(name):
    # On a CPU-only machine the other device is "meta". The op itself would dispatch to its fake
    # impl when any argument is meta (as torch.mm does), so the check is exercised directly.
    args = dict(zip(["x", "wg", "wu", "wd", "bg", "bu", "bd"], make_args(True, True)))
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"\b{name}\b.*meta.*cpu"):
        check_ffn_args(*args.values())


@pytest.mark.parametrize("factor", [1, torch.tensor([0.5, 0.5])], ids=["python int", "1-d"])
def test_l1_factor_must_be_a_0d_tensor(factor):
    """``l1_factor`` is read when the backward runs, so it must be a tensor (a 0-d one)."""
    args = make_args(True, True)
    with pytest.raises((ValueError, RuntimeError), match="l1_factor|Tensor"):
        ops.ffn_train(*args, torch.tensor(0.1), factor, 0)


def test_l1_coeff_must_be_a_0d_tensor():
    args = make_args(True, True)
    with pytest.raises(ValueError, match="l1_coeff"):
        ops.ffn_train(*args, torch.tensor([0.1, 0.2]), torch.tensor(1.0), 0)


def test_ffn_bwd_checks_dout_shape():
    args = make_args(True, True, lead=(6,))
    out, idx, val, count, up_val = ops.ffn_train(*args, torch.tensor(0.0), torch.tensor(1.0), 0)
    with pytest.raises(ValueError, match=r"\bdout\b"):
        ops.ffn_bwd(torch.randn(6, D + 1), *args, idx, val, count, up_val, torch.tensor(0.0), torch.tensor(1.0), 0)
    with pytest.raises(ValueError, match="l1_factor"):
        ops.ffn_bwd(torch.randn(6, D), *args, idx, val, count, up_val, torch.tensor(0.0), torch.tensor([1.0, 1.0]), 0)


# ---------------------------------------------------------------------------------------------
# Results, telemetry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("lead", [(7,), (2, 3), (2, 1, 3), ()], ids=["2d", "3d", "4d", "1d"])
def test_outputs_equal_dense_in_float64(gated, lead):
    args = make_args(gated, True, torch.float64, lead)
    expected = dense_ffn(*args)
    assert_close(ops.ffn(*args, 0), expected, rtol=1e-12, atol=1e-12, name="ffn")
    assert_close(ops.ffn_train(*args, torch.tensor(0.5, dtype=torch.float32), torch.tensor(1.0), 0)[0], expected, rtol=1e-12, atol=1e-12, name="ffn_train")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_telemetry_after_a_call(gated):
    x, wg, wu, wd, bg, bu, bd = make_args(gated, True, lead=(3, 5))
    layer = 41
    controlled = F.linear(x, wg, bg) if gated else F.linear(x, wu, bu)
    active = int((controlled > 0).sum())  # gate units (up units for a plain FFN) > 0
    expected_l1 = dense_hidden(x, wg, wu, bg, bu).abs().sum().item() / 15

    ops.ffn_train(x, wg, wu, wd, bg, bu, bd, torch.tensor(0.1), torch.tensor(1.0), layer)
    snap = telemetry.snapshot()[layer]
    assert snap["calls"] == 1
    assert snap["tokens"] == 15
    assert snap["active"] == active
    assert snap["l1"] == pytest.approx(expected_l1, rel=1e-5)
    assert 0 <= snap["dense_rows"] <= 15

    ops.ffn(x[:1], wg, wu, wd, bg, bu, bd, layer)  # inference: new counts, the last L1 is kept
    snap = telemetry.snapshot()[layer]
    assert snap["calls"] == 2 and snap["tokens"] == 5
    assert snap["active"] == int((controlled[:1] > 0).sum())
    assert snap["l1"] == pytest.approx(expected_l1, rel=1e-5)


def test_inference_only_layer_has_no_l1():
    """A layer that never ran a training call has no L1 measurement (NaN, stats() shows None), not 0."""
    ops.ffn(*make_args(True, True), 7)
    l1 = telemetry.snapshot()[7]["l1"]
    assert l1 != l1, f"L1 of a never-trained layer reads {l1!r}"


def test_telemetry_counts_are_per_layer():
    args = make_args(False, False)
    ops.ffn(*args, 3)
    ops.ffn(*args, 3)
    ops.ffn(*args, 4)
    snap = telemetry.snapshot()
    assert snap[3]["calls"] == 2 and snap[4]["calls"] == 1
    telemetry.reset()
    assert telemetry.snapshot() == {}


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------


def _dense_grads(args, dout, l1_scale=0.0):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in args]
    x, wg, wu, wd, bg, bu, bd = leaves
    h = dense_hidden(x, wg, wu, bg, bu)
    out = F.linear(h, wd, bd)
    loss = (out * dout).sum()
    if l1_scale:
        loss = loss + l1_scale * h.abs().sum() / max(1, h[..., 0].numel())
    loss.backward()
    return [None if t is None else t.grad for t in leaves]


def _op_grads(call, args, dout):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in args]
    out = call(*leaves)
    (out * dout).sum().backward()
    return [None if t is None else t.grad for t in leaves]


NAMES = ("x", "wg", "wu", "wd", "bg", "bu", "bd")


@pytest.mark.parametrize("gated,bias", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["gated-bias", "gated", "plain-bias", "plain"])
def test_ffn_under_autograd_gives_exact_gradients(gated, bias):
    """``twell::ffn`` (the inference op) differentiates exactly, without any L1 term."""
    args = make_args(gated, bias, torch.float64, (3, 5))
    dout = torch.randn(3, 5, D, dtype=torch.float64)
    got = _op_grads(lambda *a: ops.ffn(*a, 0), args, dout)
    want = _dense_grads(args, dout)
    for name, g, w in zip(NAMES, got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert_close(g, w, rtol=1e-10, atol=1e-12, name=f"d{name}")


def test_ffn_under_autograd_fp32_matches_eager():
    args = make_args(True, True, torch.float32, (4, 6))
    dout = torch.randn(4, 6, D)
    got = _op_grads(lambda *a: ops.ffn(*a, 0), args, dout)
    want = _dense_grads(args, dout)
    for name, g, w in zip(NAMES, got, want):
        assert_close(g, w, rtol=1e-4, atol=1e-5, name=f"d{name}")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("coeff,factor", [(0.0, 1.0), (0.375, 1.0), (0.375, 0.25)])  # exact in float32
def test_ffn_train_injects_l1_gradient(gated, coeff, factor):
    """Gradients of ``(out·dout).sum() + c · factor · (1/T) Σ|h|``, T = all leading dims."""
    args = make_args(gated, True, torch.float64, (2, 5))
    dout = torch.randn(2, 5, D, dtype=torch.float64)
    got = _op_grads(lambda *a: ops.ffn_train(*a, torch.tensor(coeff), torch.tensor(factor), 0)[0], args, dout)
    want = _dense_grads(args, dout, l1_scale=coeff * factor)
    for name, g, w in zip(NAMES, got, want):
        if w is not None:
            assert_close(g, w, rtol=1e-10, atol=1e-12, name=f"d{name}")


def test_l1_coeff_zero_is_exactly_off():
    args = make_args(True, True, torch.float32, (4, 3))
    dout = torch.randn(4, 3, D)
    with_zero = _op_grads(lambda *a: ops.ffn_train(*a, torch.tensor(0.0), torch.tensor(1.0), 0)[0], args, dout)
    inference = _op_grads(lambda *a: ops.ffn(*a, 0), args, dout)
    for name, a, b in zip(NAMES, with_zero, inference):
        assert torch.equal(a, b), name


def test_overflowing_rows_stay_exact():
    """Every gate unit active (H=300 > 16 slots per 128-column tile): the dense backup runs."""
    x, wg, wu, wd, bg, bu, bd = make_args(True, True, torch.float64, (4,), h=300)
    bg = bg.detach() + 100.0  # all active
    args = (x, wg, wu, wd, bg, bu, bd)
    assert_close(ops.ffn(*args, 5), dense_ffn(*args), rtol=1e-12, atol=1e-12)
    assert telemetry.snapshot()[5]["dense_rows"] == 4
    dout = torch.randn(4, D, dtype=torch.float64)
    got = _op_grads(lambda *a: ops.ffn_train(*a, torch.tensor(0.25), torch.tensor(1.0), 0)[0], args, dout)
    want = _dense_grads(args, dout, l1_scale=0.25)
    for name, g, w in zip(NAMES, got, want):
        assert_close(g, w, rtol=1e-10, atol=1e-12, name=f"d{name}")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["0x", "2x0x"])
def test_zero_tokens(gated, lead):
    """No tokens: an empty output and zero gradients (bias of the down projection included)."""
    args = make_args(gated, True, torch.float32, lead, requires_grad=True)
    out = ops.ffn_train(*args, torch.tensor(0.5), torch.tensor(1.0), 0)[0]
    assert out.shape == (*lead, D)
    out.sum().backward()
    for name, t in zip(NAMES, args):
        if t is not None:
            assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any(), name


def test_eager_backward_calls_the_implementation_and_traced_ones_the_op(monkeypatch):
    """Eager autograd skips ``twell::ffn_bwd``'s dispatch (host time); tracing (fake tensors, as
    ``torch.compile``'s AOTAutograd uses), grad mode and functorch transforms still go through
    the op, so graphs record it and double backward is refused. Both paths give the same grads."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    FB = importlib.import_module("twell_compile.lowering.ffn_bwd")  # the module (the package exports the op)

    args = make_args(True, True, torch.float64, requires_grad=True)
    x = args[0]
    calls = []
    original = FB.ffn_bwd
    monkeypatch.setattr(FB, "ffn_bwd", lambda *a: calls.append(1) or original(*a))
    out = ops.ffn_train(*args, torch.tensor(1e-3), torch.tensor(1.0), 0)[0]
    out.sum().backward()
    assert not calls, "eager backward went through the op"
    eager = [t.grad.clone() for t in args if t is not None]
    real = x.detach()
    assert FB.plain_eager((real,)) is False  # grad mode is on here
    with torch.no_grad():
        assert FB.plain_eager((real, 1)) is True
        assert FB.plain_eager((real, torch.nn.Parameter(real.clone()), None)) is True  # a model's weights
        mode = FakeTensorMode()
        assert FB.plain_eager((mode.from_tensor(real),)) is False  # a tensor subclass
        with mode:
            assert FB.plain_eager((real,)) is False  # a dispatch mode is on
        seen = []
        torch.func.vmap(lambda t: seen.append(FB.plain_eager((t,))) or t)(real)
        assert seen == [False]  # a functorch transform is on
    for t in args:
        if t is not None:
            t.grad = None
    out = ops.ffn_train(*args, torch.tensor(1e-3), torch.tensor(1.0), 0)[0]
    monkeypatch.setattr(FB, "plain_eager", lambda a: False)
    out.sum().backward()
    assert calls, "with the eager shortcut off, the backward calls the op"
    for a, b in zip(eager, [t.grad for t in args if t is not None]):
        assert torch.equal(a, b)


def test_eager_forward_calls_the_implementation_and_traced_ones_the_op(monkeypatch):
    """``twell::ffn_train`` with grad calls its implementation directly in eager mode (its own
    autograd kernel, no redispatch), also with the weights as ``nn.Parameter``s as in a model, and
    gives what the op computes without grad; traced with ``make_fx`` the graph records the op
    (``test_opcheck_all_ops`` checks its registrations)."""
    import importlib

    from torch.fx.experimental.proxy_tensor import make_fx

    FT = importlib.import_module("twell_compile.lowering.ffn_train")  # the module (the package exports the op)
    args = make_args(True, True, torch.float64, requires_grad=True)
    args = [args[0], *(None if t is None else torch.nn.Parameter(t.detach()) for t in args[1:])]
    coeff = torch.tensor(1e-3)
    with torch.no_grad():
        expected = ops.ffn_train(*args, coeff, torch.tensor(1.0), 0)
    calls = []
    original = FT.ffn_train_impl
    monkeypatch.setattr(FT, "ffn_train_impl", lambda *a: calls.append(1) or original(*a))
    got = ops.ffn_train(*args, coeff, torch.tensor(1.0), 0)
    assert calls == [1], "the eager forward did not call the implementation once"
    assert got[0].requires_grad and not any(t.requires_grad for t in got[1:])
    for a, b in zip(got, expected):
        assert torch.equal(a, b)

    def step(x, wg, wu, wd, bg, bu, bd, c):
        return ops.ffn_train(x, wg, wu, wd, bg, bu, bd, c, torch.tensor(1.0), 0)[0]

    graph = make_fx(step, tracing_mode="fake")(*args, coeff)
    assert any(n.target is ops.ffn_train.default for n in graph.graph.nodes)


def test_inference_op_calls_the_implementation_once_and_traced_calls_record_the_op(monkeypatch):
    """``twell::ffn`` with nothing for autograd to record (grad off, or no input that requires
    grad) runs its implementation directly from its autograd kernel, one call and no second
    dispatch (host time); with grad it runs it once inside its ``autograd.Function``; traced with
    ``make_fx`` the graph records the op. All give the same output."""
    import importlib

    from torch.fx.experimental.proxy_tensor import make_fx

    F_ = importlib.import_module("twell_compile.lowering.ffn")  # the module (the package exports the op)
    args = make_args(True, True, torch.float64, (2, 3))
    params = [args[0], *(None if t is None else torch.nn.Parameter(t.detach()) for t in args[1:])]
    with torch.no_grad():
        expected = ops.ffn(*args, 0)
    calls = []
    original = F_.ffn_impl
    monkeypatch.setattr(F_, "ffn_impl", lambda *a: calls.append(1) or original(*a))
    for label, run in [("no_grad", lambda: _no_grad(lambda: ops.ffn(*params, 0))),
                       ("grad on, nothing requires grad", lambda: ops.ffn(*args, 0)),
                       ("grad", lambda: ops.ffn(*params, 0))]:
        calls.clear()
        got = run()
        assert calls == [1], f"{label}: the implementation ran {len(calls)} times"
        assert torch.equal(got, expected), label
        assert got.requires_grad == (label == "grad"), label
    graph = make_fx(lambda *a: ops.ffn(*a, 0), tracing_mode="fake")(*args)
    assert any(n.target is ops.ffn.default for n in graph.graph.nodes)


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def test_double_backward_is_refused():
    args = make_args(False, False, torch.float64, requires_grad=True)
    out = ops.ffn_train(*args, torch.tensor(0.0), torch.tensor(1.0), 0)[0]
    (dx,) = torch.autograd.grad(out.sum(), args[0], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dx.sum().backward()


@pytest.mark.gpu
def test_gpu_device_without_index_names_the_states_the_ops_write():
    """"cuda" and "cuda:0" are one device: a caller that names it without an index reads the
    counters and dead-neuron state that the ops, keyed by their tensors' devices, write."""
    index = torch.cuda.current_device()
    assert telemetry.buffer(5, "cuda") is telemetry.buffer(5, torch.device("cuda", index))
    assert telemetry.fired_state(5, "cuda", 64)[0] is telemetry.fired_state(5, f"cuda:{index}", 64)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_gpu_sparse_path_counts_every_active_entry_and_dense_row(gated):
    """The CUDA sparse path's counters come from its guard kernel (``flag_rows``): they
    must equal the exact counts of the packed buffer (as packed, before the guard marks its rows
    overflowed), with no host sync on a later call; its sampled fired neurons are the buffer's."""
    from twell_compile.kernels import DEFAULT_LAYOUT, TwellPacked, gate_pack, reference
    from twell_compile.lowering import force_path

    cpu = make_args(gated, True, torch.bfloat16, (700,), d=64, h=600, seed=4)
    x, wg, wu, wd, bg, bu, bd = (None if t is None else t.cuda() for t in cpu)
    if gated:
        bg = bg - 1.0  # sparser gate: some rows overflow a tile, most do not
    else:
        bu = bu - 1.0
    x[9] = float("nan")  # a guard row
    args = (x, wg, wu, wd, bg, bu, bd)
    layer = 912 + gated  # a fresh layer: its first training call measures L1
    with force_path("sparse"):
        coeff, factor = torch.tensor(0.1, device="cuda"), torch.tensor(1.0, device="cuda")
        out, idx, val, count, _ = ops.ffn_train(*args, coeff, factor, layer)
        torch.cuda.synchronize()
        # It samples which neurons fired (``stamp_fired``): the stored ones and overflowed tiles.
        # Here every neuron fired: the NaN row is marked overflowed in every tile (and at ~16% a
        # row, each neuron fires somewhere in 700 rows). Partial stamps: tests/kernels/test_fired_neurons.py.
        last, seen = telemetry.fired_state(layer, "cuda", 600)
        fired = reference.fired_neurons(TwellPacked(idx, val, count), 600)
        assert bool(fired.all()) and seen.item() == 700
        assert torch.equal(last, torch.full_like(last, 700.0))
        snap = telemetry.snapshot()[layer]
        dense = (count > DEFAULT_LAYOUT.slots).any(-1)  # overflowed, or marked so by the guard
        assert 0 < int(dense.sum()) < 700
        assert bool(dense[9]) and snap["sparse"] == 1.0 and snap["tokens"] == 700
        true_count = gate_pack(x, wg, bg).count if gated else gate_pack(x, wu, bu).count
        assert snap["active"] == int(true_count.sum())  # the counts as packed, before the guard's marks
        assert snap["dense_rows"] == int(dense.sum())
        # The first training call measures L1, over the rows computed sparsely (docs/usage.md).
        h = dense_hidden(*(t.double() if t is not None else None for t in (x, wg, wu, bg, bu)))
        expected_l1 = h[~dense].abs().sum().item() / 700
        assert snap["l1"] == pytest.approx(expected_l1, rel=2e-3)

        torch.cuda.set_sync_debug_mode("error")
        try:
            ops.ffn(*args, layer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        again = telemetry.snapshot()[layer]
        assert again["calls"] == 2 and again["active"] == snap["active"] and again["dense_rows"] == snap["dense_rows"]
        assert again["l1"] == snap["l1"], "inference keeps the last L1"


def test_call_record_is_the_telemetry_fields_a_kernel_stores():
    """``telemetry.call_record`` is the layer's (calls, tokens, active, dense rows, sparse) fields
    with a zeroed scratch: what a counting kernel stores lands in ``stats()``; ``record_l1`` keeps
    the last L1 for the calls that do not measure it."""
    record = telemetry.call_record(21, "cpu", sparse=True)
    assert record.flag == 1.0 and record.scratch.tolist() == [0, 0, 0]
    record.values.copy_(torch.tensor([1.0, 50.0, 123.0, 4.0, 1.0], dtype=torch.float64))  # what a kernel stores
    telemetry.record_l1(21, torch.tensor(0.25))
    record = telemetry.call_record(21, "cpu", sparse=False)
    record.values.copy_(torch.tensor([2.0, 60.0, 7.0, 1.0, 0.0], dtype=torch.float64))
    snap = telemetry.snapshot()[21]
    assert snap == {"calls": 2.0, "tokens": 60.0, "active": 7.0, "dense_rows": 1.0, "l1": 0.25, "sparse": 0.0}


def test_call_records_are_kept_per_layer_device_and_path_until_reset():
    """A call finds its record without making a view (host time); one first made under
    ``torch.inference_mode`` (a view of a normal buffer) is written in place outside it; ``reset``
    starts from new buffers."""
    from twell_compile.kernels.tickets import record_without_kernel

    with torch.inference_mode():
        first = telemetry.call_record(22, torch.device("cpu"), sparse=True)
    assert telemetry.call_record(22, torch.device("cpu"), sparse=True) is first
    assert telemetry.call_record(22, torch.device("cpu"), sparse=False) is not first
    record_without_kernel(first, 9)  # in place, outside inference mode
    assert telemetry.snapshot()[22]["tokens"] == 9.0
    assert telemetry.buffer(22, "cpu") is telemetry.buffer(22, torch.device("cpu"))
    telemetry.reset()
    again = telemetry.call_record(22, torch.device("cpu"), sparse=True)
    assert again is not first and telemetry.snapshot()[22]["tokens"] == 0.0


def _first_call_under_inference_mode_then_outside(device: str, layer: int):
    """A layer first called under ``torch.inference_mode()`` (an eval loop) keeps working outside it
    (the next eval without it, a training step) and under it again, with equal outputs: the
    per-layer state made on its first call (telemetry buffers, the CUDA policy's pinned copy) is
    made of normal tensors, which later calls update in place."""
    args = [None if t is None else t.to(device) for t in make_args(True, True, torch.float32, (40,), seed=7)]
    with torch.inference_mode():
        first = ops.ffn(*args, layer)
    again = ops.ffn(*args, layer)
    params = [None if t is None else t.requires_grad_() for t in args]  # the same tensors: cached per-weight work
    out = ops.ffn_train(*params, torch.tensor(1e-3, device=device), torch.tensor(1.0, device=device), layer)[0]
    out.sum().backward()
    with torch.inference_mode():
        third = ops.ffn(*args, layer)
    assert torch.equal(first, again) and torch.equal(first, third) and torch.equal(out.detach(), first)
    assert all(p.grad is not None for p in params if p is not None)
    snap = telemetry.snapshot()[layer]
    assert snap["calls"] == 4 and snap["tokens"] == 40


def test_layer_first_called_under_inference_mode_works_outside_it():
    _first_call_under_inference_mode_then_outside("cpu", 931)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_gpu_layer_first_called_under_inference_mode_works_outside_it(path):
    from twell_compile.lowering import force_path

    with force_path(path):
        _first_call_under_inference_mode_then_outside("cuda", 932 + (path == "dense"))
