"""The CUDA path's finiteness guard (``lowering/sparse_path.py``): its kernels run under the interpreter on CPU.

The forward's guard runs inside ``sparse_ffn``, which marks the rows it sends dense in the counts;
the backward adds the rows of ``dout``. Each must flag at least every row the reference guard
flags (a superset only costs speed), and the weight facts must be recomputed when a weight
changes in place. Also the dispatch's token
thresholds in and out of CUDA-graph capture (pure host logic).
"""

import pytest
import torch

from twell_compile.kernels import DEFAULT_LAYOUT
from twell_compile.kernels import reference as R
from twell_compile.lowering import capture, cuda_ffn, cuda_graphs, dispatch_policy, sparse_path, weight_cache
from twell_compile.lowering.capture import prepare_capture
from twell_compile.lowering.dense_path import dense_backward, dense_forward
from twell_compile.lowering.dispatch_policy import LayerPolicy, force_path, is_warm, problem_signature, takes_sparse
from twell_compile.lowering.handoff import HANDOFF, remember, take_saved
from twell_compile.lowering.sparse_path import backward_guard_rows, sparse_forward
from twell_compile.lowering.weight_cache import WeightPrep


def _ffn(m=12, d=16, h=40, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g).to(dtype)
    wg, wu = (torch.randn(h, d, generator=g).to(dtype) for _ in range(2))
    wd = torch.randn(d, h, generator=g).to(dtype)
    bu = torch.randn(h, generator=g).to(dtype)
    return x, wg, wu, wd, None, bu, None


def _reference_guard(x, wg, wu, wd, bg, bu, bd):
    packed = R.gate_pack_ref(x, wg if wg is not None else wu, bg if wg is not None else bu)
    return R.dense_rows_ref(x, wg, wu, wd, bg, bu, bd, packed) & ~packed.overflow_rows()


def _forward_dense_rows(x, wg, wu, wd, bg, bu, bd):
    """The rows the sparse forward computes densely, as its counts tell the backward: rows with an
    overflowed tile, and the guard's rows, which ``sparse_ffn`` marks overflowed."""
    res = sparse_forward(x, wg, wu, wd, bg, bu, bd, False, False)
    return res.packed.overflow_rows(), res


def test_guard_flags_nonfinite_and_overflowing_rows():
    x, wg, wu, wd, _, bu, bd = _ffn()
    bg = torch.full((wg.shape[0],), -8.0, dtype=x.dtype)  # sparse gates: no row overflows by itself
    x[2, 3] = float("nan")
    x[5, 0] = float("inf")
    x[7] = 3e4  # fp16 up projection may overflow
    got, res = _forward_dense_rows(x, wg, wu, wd, bg, bu, bd)
    ref = _reference_guard(x, wg, wu, wd, bg, bu, bd)
    assert got[[2, 5, 7]].all()
    assert bool((got | ~ref).all()), "every reference guard row must be flagged"
    assert not got[[0, 1, 3]].any()
    assert torch.equal(res.out[[0, 1, 3]], R.ffn_forward_ref(x, wg, wu, wd, bg, bu, bd).out[[0, 1, 3]].to(x.dtype))


def test_guard_plain_ffn_flags_only_nonfinite_rows():
    x, _, wu, wd, _, _, bd = _ffn(dtype=torch.float32)
    bu = torch.full((wu.shape[0],), -8.0)
    x[4, 1] = float("nan")
    got, _ = _forward_dense_rows(x, None, wu, wd, None, bu, bd)
    assert got.tolist() == [i == 4 for i in range(x.shape[0])]


def test_guard_marks_only_rows_without_an_overflowed_tile():
    """A guard row keeps its true counts in every tile but the first, which becomes slots + 1; a
    row that already overflows keeps its counts."""
    from twell_compile.kernels import gate_pack

    slots = DEFAULT_LAYOUT.slots
    for h, marked_rows in ((slots, [1, 6]), (40, [])):  # a tile of <= slots columns never overflows
        x, wg, wu, wd, _, bu, bd = _ffn(h=h)
        bg = torch.full((h,), -8.0, dtype=x.dtype)
        x[1] = 3e4  # finite, but its fp16 up projection may overflow: the guard sends it dense
        x[6, 2] = float("nan")  # every gate NaN, so active
        true = gate_pack(x, wg, bg).count
        assert (int(true[6, 0]) > slots) == (h > slots)
        _, res = _forward_dense_rows(x, wg, wu, wd, bg, bu, bd)
        marked = ~torch.eq(res.packed.count, true).all(-1)
        assert marked.nonzero().flatten().tolist() == [r for r in marked_rows if int(true[r, 0]) <= slots]
        assert all(int(res.packed.count[r, 0]) == slots + 1 for r in marked_rows)
        assert res.packed.overflow_rows()[[1, 6]].all()


def test_weight_facts_follow_in_place_updates():
    x, wg, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
    bg = torch.full((wg.shape[0],), -8.0)
    assert not _forward_dense_rows(x, wg, wu, wd, bg, bu, bd)[0].any()
    wd[0, 0] = float("inf")  # bumps wd._version: the cached facts must not be reused
    assert _forward_dense_rows(x, wg, wu, wd, bg, bu, bd)[0].all()


def test_weight_facts_work_for_inference_mode_tensors():
    with torch.inference_mode():
        x, wg, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
        bg = torch.full((wg.shape[0],), -8.0)
        assert not _forward_dense_rows(x, wg, wu, wd, bg, bu, bd)[0].any()


def test_backward_guard_adds_dout_rows_to_the_forwards_dense_rows():
    x, wg, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
    bg = torch.full((wg.shape[0],), -8.0)
    x[5, 0] = float("inf")
    _, res = _forward_dense_rows(x, wg, wu, wd, bg, bu, bd)
    dout = torch.randn_like(x)
    dout[3, 2] = float("nan")
    got, listed = backward_guard_rows(dout, WeightPrep.get(wg, wu, wd, bg, bu, bd)[1], res.packed)
    ref = R.backward_dense_rows_ref(dout, x, wg, wu, wd, bg, bu, bd, R.gate_pack_ref(x, wg, bg))
    assert bool((got | ~ref).all())
    assert got[3] and got[5]
    rows = torch.nonzero(got).flatten().to(torch.int32)
    assert listed.n_dense.item() == rows.numel() and torch.equal(listed.rows[: rows.numel()], rows)


@pytest.mark.parametrize("keep", [True, False])
def test_weight_prep_runs_at_most_once_per_forward_and_once_per_backward(monkeypatch, keep):
    """Uncached (under capture, or for layers compiled for CUDA graphs) the per-weight work is a
    launch that reads every weight: each direction makes it once and passes it on. Cached, a
    step with unchanged weights makes it once in all."""
    x, wg, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
    wd = wd.clone()  # a weight no other test has cached
    calls = []
    real = weight_cache.weight_prep
    monkeypatch.setattr(weight_cache, "weight_prep", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = 8_888
    if not keep:
        monkeypatch.setattr(cuda_graphs, "CUDA_GRAPH_LAYERS", {layer})
    res = sparse_forward(x, wg, wu, wd, None, bu, bd, True, False, keep=keep)
    assert len(calls) == 1
    dout = torch.randn_like(x)
    cuda_ffn.backward(dout, x, wg, wu, wd, None, bu, bd, res.packed, res.up_val, torch.tensor(0.0), layer=layer)
    assert len(calls) == (1 if keep else 2)



def test_the_paths_launch_kernels_without_checking_their_arguments_again(monkeypatch):
    """The ops check their arguments once a call (``lowering/checks.py``) and make every other
    launcher argument themselves, so each launcher of both paths gets ``check=False`` (its checks
    cost ~50 µs of host time an inference call, ~160 µs a training step); the results are still
    the reference's."""
    from twell_compile.lowering import dense_path

    seen = []

    def spy(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: seen.append((name, k.get("check", True))) or real(*a, **k))

    for name in ("gate_pack", "sparse_ffn", "sparse_ffn_backward", "flag_rows"):
        spy(sparse_path, name)
    for name in ("dense_activation", "dense_activation_backward"):
        spy(dense_path, name)
    x, wg, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
    dout, scale = torch.randn_like(x), torch.tensor(0.25)
    ref = R.ffn_forward_ref(x, wg, wu, wd, None, bu, bd)
    ref_grads = R.ffn_backward_ref(dout, x, wg, wu, wd, None, bu, bd, ref.packed, ref.up_val, scale)
    res = sparse_forward(x, wg, wu, wd, None, bu, bd, True, False)
    grads = cuda_ffn.backward(dout, x, wg, wu, wd, None, bu, bd, res.packed, res.up_val, scale)
    dense, saved = dense_forward(x, wg, wu, wd, None, bu, bd, True, False)
    dense_grads = dense_backward(dout, x, wg, wu, wd, None, bu, bd, scale, saved)
    assert {name for name, _ in seen} == {"gate_pack", "sparse_ffn", "sparse_ffn_backward", "flag_rows",
                                          "dense_activation", "dense_activation_backward"}
    assert not [name for name, check in seen if check], "a launcher checked its arguments again"
    for out in (res.out, dense.out):
        assert torch.allclose(out, ref.out, rtol=1e-4, atol=1e-4)
    for got in (grads, dense_grads):
        for name in ("dx", "dwg", "dwu", "dwd", "dbu"):
            assert torch.allclose(getattr(got, name), getattr(ref_grads, name), rtol=1e-4, atol=1e-4), name



def test_a_sparse_call_makes_five_launches_and_a_training_step_fifteen(monkeypatch):
    """Each launch costs 15-27 µs of host time on the H200's hosts, so the launch count is most of
    the sparse path's host-time budget (docs/benchmarks.md, "Host time of the TwELL ops"): an
    inference call makes 5 (gate GEMM, pair loop, dense-row list, dense rows' scratch and product)
    and a training step 15, weights unchanged. A change to either count changes that budget."""
    import importlib
    import pkgutil

    import twell_compile.kernels as kernels_pkg
    from twell_compile.kernels import launch as launch_module

    real = launch_module.launch
    launched = []

    def counting(kernel, grid, *args, **kwargs):
        fn = kernel
        while hasattr(fn, "fn"):
            fn = fn.fn
        launched.append(fn.__name__)
        return real(kernel, grid, *args, **kwargs)

    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        module = importlib.import_module(f"twell_compile.kernels.{info.name}")
        if getattr(module, "launch", None) is real:
            monkeypatch.setattr(module, "launch", counting)
    x, wg, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
    wd = wd.clone()  # its own weight cache entry
    dout, scale = torch.randn_like(x), torch.tensor(0.25)

    def step():
        res = sparse_forward(x, wg, wu, wd, None, bu, bd, True, False)
        cuda_ffn.backward(dout, x, wg, wu, wd, None, bu, bd, res.packed, res.up_val, scale, layer=8_889)

    sparse_forward(x, wg, wu, wd, None, bu, bd, False, False)
    step()  # the first: the weight pass, and the other weight-gradient variant's warm-up
    launched.clear()
    sparse_forward(x, wg, wu, wd, None, bu, bd, False, False)
    assert len(launched) == 5, launched
    launched.clear()
    step()
    assert len(launched) == 15, launched


# The dense path and its saved activations are plain torch too.


def _grads_close(a, b, tol=1e-10):
    for name, ga, gb in zip(a._fields, a, b):
        assert (ga is None) == (gb is None), name
        if ga is not None:
            assert torch.allclose(ga, gb, rtol=tol, atol=tol), name


def test_dense_backward_on_saved_activations_equals_recomputing():
    for gated in (True, False):
        x, wg, wu, wd, _, bu, _ = _ffn(dtype=torch.float64)
        wg = wg if gated else None
        dout = torch.randn_like(x)
        scale = torch.tensor(0.3, dtype=torch.float64)
        res, saved = dense_forward(x, wg, wu, wd, None, bu, None, True, False)
        assert len(saved) == 3
        before = [t.clone() for t in saved]
        kept = dense_backward(dout, x, wg, wu, wd, None, bu, None, scale, saved)
        recomputed = dense_backward(dout, x, wg, wu, wd, None, bu, None, scale)
        _grads_close(kept, recomputed)
        # and both are autograd of loss + scale · (1/M) Σ|h|
        ref = R.ffn_backward_ref(dout, x, wg, wu, wd, None, bu, None, R.gate_pack_ref(x, wg if gated else wu, None if gated else bu),
                                 R.ffn_forward_ref(x, wg, wu, wd, None, bu, None).up_val, scale)
        for name in ("dx", "dwg", "dwu", "dwd", "dbu"):
            got, want = getattr(kept, name), getattr(ref, name)
            assert (got is None) == (want is None), name
            if got is not None:
                assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), name
        assert all(torch.equal(a, b) for a, b in zip(saved, before))  # nothing saved is modified in place


def test_saved_activations_are_popped_once_and_not_kept_under_saved_tensor_hooks():
    count = torch.zeros(4, 2, dtype=torch.int32)
    remember(count, True, ("act", "up", "h"))
    assert take_saved(count.data_ptr(), dense=True) == ("act", "up", "h")
    assert take_saved(count.data_ptr(), dense=True) is None  # popped
    remember(count, False, None)  # a later sparse forward at the same address clears it
    assert count.data_ptr() not in HANDOFF
    remember(count, True, ("act", "up", "h"))
    remember(count, False)
    assert count.data_ptr() not in HANDOFF
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        remember(count, True, ("act", "up", "h"))
    assert count.data_ptr() not in HANDOFF


def test_a_backward_being_captured_takes_only_activations_a_capture_recorded(monkeypatch):
    """Activations kept by an eager forward would be freed after a captured backward's use while
    its graph kept reading their memory; those a capture recorded live in the graph's pool."""
    count = torch.zeros(4, 2, dtype=torch.int32)
    remember(count, True, ("act", "up", "h"))  # eager forward
    monkeypatch.setattr(cuda_graphs, "capturing", lambda: True)
    assert take_saved(count.data_ptr(), dense=True) is None
    assert count.data_ptr() not in HANDOFF  # dropped, not left to go stale
    remember(count, True, ("act", "up", "h"))  # captured forward
    assert take_saved(count.data_ptr(), dense=True) == ("act", "up", "h")
    remember(count, True, ("act", "up", "h"))
    monkeypatch.setattr(cuda_graphs, "capturing", lambda: False)  # an eager backward after a replay
    assert take_saved(count.data_ptr(), dense=True) == ("act", "up", "h")
    remember(count, True, ("act", "up", "h"))
    assert take_saved(count.data_ptr(), dense=False) is None  # only the path that made it


def test_a_captured_sparse_step_makes_the_weight_prep_once(monkeypatch):
    """Under capture nothing is cached per weight: the sparse forward hands its prep to the
    backward instead of the backward launching it again; the gradients are the same."""
    x, wg, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
    calls = []
    real = weight_cache.weight_prep
    monkeypatch.setattr(weight_cache, "weight_prep", lambda *a, **k: calls.append(1) or real(*a, **k))

    class Policy:  # the real one copies counters to pinned memory: CUDA only
        calls = 1

        def after(self, *_):
            pass

        def expects_dense_rows(self, *_):
            return False

    monkeypatch.setitem(dispatch_policy.POLICIES, (8_889, 0), Policy())
    dout = torch.randn_like(x)

    def step(capturing):
        monkeypatch.setattr(cuda_graphs, "capturing", lambda: capturing)
        w = wd.clone()  # uncached in both runs
        res, sparse = cuda_ffn.forward(x, wg, wu, w, None, bu, bd, layer=8_889, training=True)
        assert sparse
        return cuda_ffn.backward(dout, x, wg, wu, w, None, bu, bd, res.packed, res.up_val, torch.tensor(0.0), layer=8_889)

    with force_path("sparse"):
        eager = step(False)
        assert len(calls) == 1  # the backward hit the cache
        captured = step(True)
        assert len(calls) == 2, "the captured backward used the forward's prep"
    for name in ("dx", "dwg", "dwu", "dwd", "dbu"):
        assert torch.equal(getattr(captured, name), getattr(eager, name)), name


def test_weight_prep_is_kept_until_a_weight_changes():
    """The bounds and the ``Wdᵀ`` rows come from one launch, kept per down weight while no weight
    changes (any of them: the bounds depend on all), and match ``guard_bounds`` and
    ``transposed``."""
    from twell_compile.kernels import guard_bounds, transposed

    _, wg, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
    first = WeightPrep.get(wg, wu, wd, None, bu, bd)
    fwd, bwd = guard_bounds(wg, wu, wd, None, bu, bd)
    assert torch.equal(first[0], fwd) and torch.equal(first[1], bwd)
    assert first[2].t().is_contiguous() and torch.equal(first[2].t(), transposed(wd))
    assert WeightPrep.get(wg, wu, wd, None, bu, bd) is first
    wd.mul_(2)  # in-place update: version bump
    second = WeightPrep.get(wg, wu, wd, None, bu, bd)
    assert second is not first and torch.equal(second[2], wd)
    wu.mul_(2)
    third = WeightPrep.get(wg, wu, wd, None, bu, bd)
    assert third is not second and torch.equal(third[2], second[2]) and not torch.equal(third[0], second[0])
    rows = torch.randn(wd.shape[1], wd.shape[0])
    assert WeightPrep.get(wg, wu, rows.t(), None, bu, bd)[2].data_ptr() == rows.data_ptr()  # no copy


def test_weight_prep_is_never_kept_for_layers_whose_weights_are_gathered():
    """FSDP2 frees a layer's unsharded weights after each use: a kept ``Wdᵀ`` would outlive them."""
    _, wg, wu, wd, _, bu, bd = _ffn(dtype=torch.float32)
    layer = 10_000
    weight_cache.mark_gathered_weight_layers([layer])
    try:
        first = WeightPrep.get(wg, wu, wd, None, bu, bd, layer=layer)
        assert id(wd) not in WeightPrep.cache
        again = WeightPrep.get(wg, wu, wd, None, bu, bd, layer=layer)
        assert again is not first and torch.equal(again[2], first[2])
        assert WeightPrep.get(wg, wu, wd, None, bu, bd, layer=layer + 1) is WeightPrep.get(wg, wu, wd, None, bu, bd)
    finally:
        weight_cache.GATHERED_WEIGHT_LAYERS.discard(layer)
        WeightPrep.cache.pop(id(wd), None)


def _measured_policy(density: float, dense_row_fraction: float = 0.0):
    """A policy whose last call measured ``density`` (no pinned buffer on a CPU machine)."""
    policy = LayerPolicy.__new__(LayerPolicy)
    policy.event, policy.measured, policy.density, policy.dense_row_fraction = None, True, density, dense_row_fraction
    return policy


def test_token_thresholds_in_and_out_of_capture(monkeypatch):
    """Outside capture: sparse from SPARSE_MIN_TOKENS, and once from SPARSE_MIN_TOKENS_CAPTURED
    while the problem is cold (to tune its kernels) where a capture would record it sparse; in a
    capture: from SPARSE_MIN_TOKENS_CAPTURED, warm problems only. A training problem is warm once
    both its forward and backward ran."""
    monkeypatch.setattr(dispatch_policy, "WARM", set())
    low, high = dispatch_policy.SPARSE_MIN_TOKENS_CAPTURED, dispatch_policy.SPARSE_MIN_TOKENS
    assert low < dispatch_policy.SPARSE_FULL_TOKENS_CAPTURED < high
    policy = _measured_policy(0.001)
    x, wg, wu, wd, bg, bu, bd = _ffn()
    for training in (False, True):
        sig = problem_signature(x, wg, wu, bg, bu, bd, training)
        takes = lambda m, capturing: takes_sparse(policy, m, sig, training, capturing)  # noqa: E731
        assert not is_warm(sig)
        assert [takes(m, False) for m in (low - 1, low, high - 1, high)] == [False, True, True, True]
        assert [takes(m, True) for m in (low, high)] == [False, False]
        dispatch_policy.WARM.add(("forward", *sig))
        assert is_warm(sig) == (not training)
        dispatch_policy.WARM.add(("backward", *sig))
        assert is_warm(sig)
        assert [takes(m, False) for m in (low - 1, low, high - 1, high)] == [False, False, False, True]
        assert [takes(m, True) for m in (low - 1, low, high)] == [False, True, True]
    assert problem_signature(x, None, wu, None, bu, bd, False) != problem_signature(x, wg, wu, bg, bu, bd, False)


def test_every_call_takes_in_the_counters_so_that_a_capture_knows_the_density(monkeypatch):
    """A warm problem's eager calls under SPARSE_MIN_TOKENS tokens go dense without asking the
    policy; they must still take in each completed counters copy, or a later capture would find the
    layer's density unknown and record the dense path (as the bench did at 3072-4096 tokens)."""
    monkeypatch.setattr(dispatch_policy, "WARM", set())
    x, wg, wu, wd, bg, bu, bd = _ffn()
    sig = problem_signature(x, wg, wu, bg, bu, bd, False)
    dispatch_policy.WARM.add(("forward", *sig))

    class Completed:
        def query(self):
            return True

    policy = LayerPolicy.__new__(LayerPolicy)
    policy.event, policy.measured, policy.hidden = Completed(), False, wu.shape[0]
    policy.density = policy.dense_row_fraction = 1.0
    tokens = dispatch_policy.SPARSE_MIN_TOKENS_CAPTURED
    policy.host = torch.tensor([1.0, tokens, 0.001 * tokens * wu.shape[0], 0.0, 0.0, float("nan")], dtype=torch.float64)
    assert not takes_sparse(policy, tokens, sig, False, False)  # eager, warm, few tokens: dense
    assert policy.measured and policy.density < dispatch_policy.SPARSE_MAX_DENSITY_FEW_TOKENS
    assert policy.choose_captured(False, tokens)


def test_a_capture_of_few_tokens_records_the_sparse_path_only_at_a_lower_density(monkeypatch):
    """Below SPARSE_FULL_TOKENS_CAPTURED tokens the sparse path's fixed costs weigh more, so a
    capture records it only under SPARSE_MAX_DENSITY_FEW_TOKENS; from there under the eager
    density limit. A cold problem goes sparse outside capture only where a capture would."""
    monkeypatch.setattr(dispatch_policy, "WARM", set())
    low, full = dispatch_policy.SPARSE_MIN_TOKENS_CAPTURED, dispatch_policy.SPARSE_FULL_TOKENS_CAPTURED
    few = dispatch_policy.SPARSE_MAX_DENSITY_FEW_TOKENS
    x, wg, wu, wd, bg, bu, bd = _ffn()
    for training in (False, True):
        limit = dispatch_policy.SPARSE_MAX_DENSITY["training" if training else "inference"]
        assert few < limit
        sig = problem_signature(x, wg, wu, bg, bu, bd, training)
        between = _measured_policy((few + limit) / 2)
        below = _measured_policy(few / 2)
        assert [between.choose_captured(training, m) for m in (low - 1, low, full - 1, full)] == [False, False, False, True]
        assert [below.choose_captured(training, m) for m in (low - 1, low, full - 1, full)] == [False, True, True, True]
        assert between.choose(training) and below.choose(training)  # eager calls: the one limit
        # cold: the tuning call goes sparse only where a capture would record it sparse
        assert not takes_sparse(between, low, sig, training, False)
        assert takes_sparse(between, full, sig, training, False)
        assert takes_sparse(below, low, sig, training, False)


def test_a_cuda_graph_warm_up_tunes_the_sparse_kernels_only_for_a_sparse_layer(monkeypatch):
    """Layers compiled for CUDA graphs are warmed up by one eager call, then recorded: on that call
    the sparse kernels run once (forward, and backward in training) when the layer measures sparse,
    so the recording can take the sparse path; nothing per weight is kept (the graphs' memory pool
    forbids it)."""
    layer = 4_242
    monkeypatch.setattr(dispatch_policy, "WARM", set())
    monkeypatch.setattr(cuda_graphs, "CUDA_GRAPH_LAYERS", {layer})
    monkeypatch.setattr(WeightPrep, "cache", {})
    x, wg, wu, wd, bg, bu, bd = _ffn(dtype=torch.float32)
    policy = LayerPolicy.__new__(LayerPolicy)  # no pinned buffer on a CPU machine
    policy.event, policy.measured, policy.dense_row_fraction = None, True, 0.0
    monkeypatch.setattr(dispatch_policy, "SPARSE_MIN_TOKENS_CAPTURED", x.shape[0])
    for training in (False, True):
        sig = problem_signature(x, wg, wu, bg, bu, bd, training)
        prepare = lambda sparse: prepare_capture(  # noqa: E731
            policy, x, wg, wu, wd, bg, bu, bd, sparse, training, sig, layer)
        policy.density = 0.5  # measured dense: the recording takes the dense path, nothing to tune
        prepare(False)
        assert not is_warm(sig)
        policy.density = 0.001
        prepare(True)  # this call ran sparse: its own kernels were tuned
        assert not is_warm(sig)
        monkeypatch.setattr(dispatch_policy, "SPARSE_MIN_TOKENS_CAPTURED", x.shape[0] + 1)
        prepare(False)  # too few tokens to be recorded sparse
        assert not is_warm(sig)
        monkeypatch.setattr(dispatch_policy, "SPARSE_MIN_TOKENS_CAPTURED", x.shape[0])
        prepare(False)
        assert is_warm(sig)
    assert WeightPrep.cache == {}

    # A new layer of a tuned problem: its first counters are read on its warm-up call, so that the
    # capture that follows (which cannot read them) knows the layer is sparse.
    class CopiedEvent:
        synchronized = False

        def synchronize(self):
            self.synchronized = True

        def query(self):
            return self.synchronized

    fresh = LayerPolicy.__new__(LayerPolicy)
    fresh.event, fresh.measured, fresh.hidden = CopiedEvent(), False, wu.shape[0]
    fresh.density = fresh.dense_row_fraction = 1.0
    tokens, active = x.shape[0], 0.001 * x.shape[0] * wu.shape[0]
    fresh.host = torch.tensor([1.0, tokens, active, 0.0, 0.0, float("nan")], dtype=torch.float64)
    prepare_capture(fresh, x, wg, wu, wd, bg, bu, bd, False, True, sig, layer)
    assert fresh.measured and fresh.density < 0.01 and fresh.choose(training=True)


def test_a_warm_up_without_memory_for_the_sparse_kernels_only_warns(monkeypatch):
    """The warm-up's extra sparse run needs memory the call itself did not: running out of it
    leaves the layer cold (its capture records dense) and the call's result stands."""
    layer = 4_243
    monkeypatch.setattr(dispatch_policy, "WARM", set())
    monkeypatch.setattr(dispatch_policy, "SPARSE_MIN_TOKENS_CAPTURED", 1)

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(capture, "sparse_forward", out_of_memory)
    x, wg, wu, wd, bg, bu, bd = _ffn(dtype=torch.float32)
    policy = _measured_policy(0.001)
    sig = problem_signature(x, wg, wu, bg, bu, bd, True)
    with pytest.warns(RuntimeWarning, match=f"layer {layer}.*dense path"):
        prepare_capture(policy, x, wg, wu, wd, bg, bu, bd, False, True, sig, layer)
    assert not is_warm(sig)


def test_a_capture_records_the_sparse_path_only_with_few_dense_rows():
    """A graph replays its path for good, so a capture takes the sparse path under a stricter limit
    on the rows computed densely than an eager call, which the next call can revise."""
    policy = _measured_policy(0.001)
    tokens = dispatch_policy.SPARSE_FULL_TOKENS_CAPTURED
    capture_limit = dispatch_policy.SPARSE_MAX_DENSE_ROWS_CAPTURED
    for training in (False, True):
        eager_limit = dispatch_policy.SPARSE_MAX_DENSE_ROWS["training" if training else "inference"]
        assert capture_limit < eager_limit
        for fraction, eager, captured in ((0.0, True, True), (capture_limit / 2, True, True),
                                          ((capture_limit + eager_limit) / 2, True, False), (eager_limit, False, False)):
            policy.dense_row_fraction = fraction
            assert policy.choose(training) == eager, (training, fraction)
            assert policy.choose_captured(training, tokens) == captured, (training, fraction)


def test_dense_row_limits_stay_within_the_kernels_scratch():
    """Each dense row costs a training step ~4x what it costs an inference call, so training's limit
    is lower; neither lets more rows go dense than the kernels' scratch holds."""
    from twell_compile.kernels import DENSE_ROW_FRACTION_MAX

    limits = dispatch_policy.SPARSE_MAX_DENSE_ROWS
    assert limits["training"] < limits["inference"] <= DENSE_ROW_FRACTION_MAX
    policy = _measured_policy(0.001)
    policy.dense_row_fraction = (limits["training"] + limits["inference"]) / 2
    assert policy.choose(False) and not policy.choose(True)


def test_the_backward_expects_dense_rows_only_from_a_measured_call():
    """The dense rows' weight gradients go through GEMMs (an fp32 [planes, H, D] buffer) only when
    the layer's last measured call had enough dense rows: an unmeasured layer allocates nothing."""
    from twell_compile.kernels import DENSE_WGRAD_GEMM_ROWS

    policy = LayerPolicy.__new__(LayerPolicy)
    policy.event, policy.measured, policy.dense_row_fraction = None, False, 1.0
    assert not policy.expects_dense_rows(16384, DENSE_WGRAD_GEMM_ROWS)
    policy.measured = True
    for rows, expected in ((DENSE_WGRAD_GEMM_ROWS, True), (DENSE_WGRAD_GEMM_ROWS - 1, False), (0, False)):
        policy.dense_row_fraction = rows / 16384
        assert policy.expects_dense_rows(16384, DENSE_WGRAD_GEMM_ROWS) == expected, rows


@pytest.mark.parametrize("dense_rows, expected", [(0.0, False), (0.01, True)])
def test_the_backward_takes_the_gemm_route_from_the_layers_last_dense_rows(monkeypatch, dense_rows, expected):
    """``cuda_ffn.backward`` asks the kernels for the GEMM route exactly when the layer's last
    measured call had ``DENSE_WGRAD_GEMM_ROWS`` or more dense rows (here 1% of 1000 rows: 10). The
    problem's first backward also runs the other route once, result discarded, so that both
    weight-gradient variants are tuned then and not in the middle of training; running out of
    memory there only leaves it for later."""
    routes = []

    def fake_backward(*args, dense_wgrad_gemm=False, **kwargs):
        routes.append(dense_wgrad_gemm)
        if len(routes) == 2 and dense_rows == 0.01:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return f"grads {len(routes)}"

    monkeypatch.setattr(sparse_path, "sparse_ffn_backward", fake_backward)
    monkeypatch.setattr(dispatch_policy, "WARM", set())
    x, wg, wu, wd, bg, bu, bd = _ffn(m=1000, dtype=torch.float32)
    packed = R.gate_pack_ref(x, wg, bg)
    layer = 987_654
    policy = LayerPolicy.__new__(LayerPolicy)  # no pinned memory on CPU
    policy.event, policy.measured, policy.dense_row_fraction = None, True, dense_rows
    monkeypatch.setitem(dispatch_policy.POLICIES, (layer, 0), policy)

    def backward():
        return cuda_ffn.backward(torch.ones_like(x), x, wg, wu, wd, bg, bu, bd, packed,
                                  torch.zeros(packed.val.shape), torch.tensor(0.0), layer=layer)

    assert backward() == "grads 1" and routes == [expected, not expected]
    assert backward() == "grads 3" and routes == [expected, not expected, expected]
