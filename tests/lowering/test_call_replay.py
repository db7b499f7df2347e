"""``call_replay``'s rules that need no GPU: which calls may be replayed, the switch, and the bounds
on recorded graphs (the replays themselves: ``test_call_replay_gpu.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from unittest import mock

import pytest
import torch

from twell_compile.lowering import call_replay, weight_cache


def test_only_cuda_calls_outside_captures_and_up_to_the_work_limit_are_eligible(monkeypatch):
    x = torch.zeros(8, 4)
    assert not call_replay.eligible(x, 4, 1, capturing=False, keep=True), "CPU tensors"
    cuda_like = torch.empty(8, 4, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert call_replay.eligible(cuda_like, 4, 1, capturing=False, keep=True)
    assert not call_replay.eligible(cuda_like, 4, 1, capturing=True, keep=True)
    assert not call_replay.eligible(cuda_like, 4, 1, capturing=False, keep=False)
    monkeypatch.setattr(call_replay, "REPLAY_MAX_WORK", 8 * 4 * 4)
    assert call_replay.eligible(cuda_like, 4, 1, capturing=False, keep=True)
    big = torch.empty(9, 4, device="meta")
    assert not call_replay.eligible(big, 4, 1, capturing=False, keep=True)
    monkeypatch.setattr(weight_cache, "GATHERED_WEIGHT_LAYERS", {1})
    assert not call_replay.eligible(cuda_like, 4, 1, capturing=False, keep=True)
    monkeypatch.setattr(call_replay, "ENABLED", False)
    assert not call_replay.eligible(cuda_like, 4, 2, capturing=False, keep=True)


def test_every_call_under_the_eager_sparse_limit_at_the_2b_shape_may_be_replayed(monkeypatch):
    # Otherwise calls between the two limits would be neither replayed nor sparse: dense by size.
    from twell_compile.lowering import dispatch_policy

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    below = torch.empty(dispatch_policy.SPARSE_MIN_TOKENS - 1, 2048, device="meta")
    assert call_replay.eligible(below, 5632, 1, capturing=False, keep=True)


def test_replays_off_is_scoped_and_restored_when_the_block_raises(monkeypatch):
    monkeypatch.setattr(call_replay, "ENABLED", True)
    with call_replay.replays_off():
        assert not call_replay.ENABLED
    assert call_replay.ENABLED
    with pytest.raises(RuntimeError, match="boom"), call_replay.replays_off():
        raise RuntimeError("boom")
    assert call_replay.ENABLED


@pytest.mark.parametrize("value, ok", [("0", True), ("1", True), ("yes", False), ("", False)])
def test_the_switch_takes_0_or_1_and_names_itself_otherwise(value, ok):
    env = {**os.environ, "TWELL_CALL_REPLAY": value}
    code = "import twell_compile.lowering.call_replay as c; print(c.ENABLED)"
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str(value == "1")
    else:
        assert proc.returncode != 0 and "TWELL_CALL_REPLAY must be 0 or 1" in proc.stderr


class _Graphs(call_replay.KeyState):
    def __init__(self, n):
        super().__init__()
        self.graphs = [types.SimpleNamespace(training=False, bytes=0, backward={}) for _ in range(n)]


def test_eviction_keeps_the_layer_and_total_bounds_dropping_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(call_replay, "KEYS", type(call_replay.KEYS)())
    monkeypatch.setattr(call_replay, "GRAPHS_PER_LAYER", 3)
    monkeypatch.setattr(call_replay, "GRAPHS_MAX", 5)
    keys = call_replay.KEYS
    for i in range(4):
        keys[(7, 0, True, (i,))] = _Graphs(1)
    call_replay._evict((7, 0))
    assert [len(s.graphs) for s in keys.values()] == [0, 1, 1, 1], "the oldest key of the layer lost its graph"
    keys[(8, 0, True, (1,))] = _Graphs(2)
    keys[(8, 0, True, (2,))] = _Graphs(1)
    call_replay._evict((8, 0))
    graphs = {k: len(s.graphs) for k, s in keys.items()}
    assert sum(graphs.values()) <= 5
    assert graphs[(8, 0, True, (2,))] == 1 and graphs[(8, 0, True, (1,))] == 2, "the newest keys keep theirs"
    assert graphs[(7, 0, True, (1,))] == 0, "other layers' oldest graphs go first past the total"


def test_no_recording_once_the_kept_graphs_hold_their_share_of_the_device(monkeypatch, stand_in_replays):
    from twell_compile.lowering import cuda_ffn, force_path

    monkeypatch.setattr(call_replay, "has_room", lambda device: call_replay.held_bytes < 100)
    monkeypatch.setattr(call_replay, "held_bytes", 100)
    x, wg, wu, wd = _ffn()
    with torch.no_grad(), force_path("sparse"):
        for _ in range(4):
            cuda_ffn.forward(x, wg, wu, wd, None, None, None, layer=8_840, training=False)
    (state,) = [s for k, s in call_replay.KEYS.items() if k[0] == 8_840]
    assert state.eager_calls == 4 and not state.graphs


def test_has_room_compares_the_held_bytes_with_the_devices_share(monkeypatch):
    monkeypatch.setattr(call_replay, "_device_bytes", {0: 1000})
    monkeypatch.setattr(call_replay, "held_bytes", int(1000 * call_replay.MEMORY_SHARE) - 1)
    assert call_replay.has_room(torch.device("cuda", 0))
    monkeypatch.setattr(call_replay, "held_bytes", int(1000 * call_replay.MEMORY_SHARE))
    assert not call_replay.has_room(torch.device("cuda", 0))


def test_clearing_a_key_returns_its_graphs_bytes_and_drops_their_backward_graphs(monkeypatch):
    monkeypatch.setattr(call_replay, "TRAINING_FORWARDS", {})
    backward = call_replay.KeyState()
    backward.graphs = [types.SimpleNamespace(training=False, bytes=30, backward={})]
    state = call_replay.KeyState()
    state.graphs = [types.SimpleNamespace(training=False, bytes=70, backward={("gemm",): backward})]
    monkeypatch.setattr(call_replay, "held_bytes", 100)
    call_replay._clear(state)
    assert call_replay.held_bytes == 0 and not state.graphs and not backward.graphs


def test_stats_count_the_kept_forward_and_backward_graphs(monkeypatch):
    monkeypatch.setattr(call_replay, "KEYS", type(call_replay.KEYS)())
    monkeypatch.setattr(call_replay, "held_bytes", 1234)
    backward = _Graphs(1)
    forward = _Graphs(2)
    forward.graphs[0].backward = {("gemm",): backward}
    call_replay.KEYS[(7, 0, True, True, (8,), "w")] = forward
    outcomes = {"forward replayed": 4, "forward recorded": 3, "backward recorded": 2}
    monkeypatch.setattr(call_replay, "OUTCOMES", type(call_replay.OUTCOMES)(outcomes))
    assert call_replay.stats() == (5, 3, 1234, outcomes)


def test_warm_ups_count_the_calls_that_do_once_only_work(monkeypatch):
    """A key's eager first call, a recording and a failed capture: a step-time measurement over a
    step with one of them is taken again (``lowering.first_launches``); replays and held results
    are the steady state."""
    from twell_compile.lowering import first_launches

    monkeypatch.setattr(call_replay, "OUTCOMES", type(call_replay.OUTCOMES)())
    before = first_launches()
    for outcome in ("forward replayed", "forward eager: its graphs' results still held", "backward replayed",
                    "forward eager: memory share spent"):
        call_replay.OUTCOMES[outcome] += 1
    assert call_replay.warm_ups() == 0 and first_launches() == before
    for outcome in call_replay._WARM_UPS:
        call_replay.OUTCOMES[outcome] += 1
    assert call_replay.warm_ups() == len(call_replay._WARM_UPS) and first_launches() == before + len(call_replay._WARM_UPS)


def test_a_new_weight_state_drops_the_layers_other_inference_keys_only(monkeypatch):
    monkeypatch.setattr(call_replay, "KEYS", type(call_replay.KEYS)())
    monkeypatch.setattr(call_replay, "OUTCOMES", type(call_replay.OUTCOMES)())
    keys = call_replay.KEYS
    # (layer, device, path, training, ..., reads)
    keys[(7, 0, True, False, (8,), "old")] = _Graphs(1)
    keys[(7, 0, False, False, (16,), "old")] = _Graphs(1)
    keys[(7, 0, True, True, (8,), "training")] = _Graphs(1)
    keys[(9, 0, True, False, (8,), "old")] = _Graphs(1)
    call_replay._drop_stale((7, 0, True, False, (8,), "new"))
    assert list(keys) == [(7, 0, True, True, (8,), "training"), (9, 0, True, False, (8,), "old")]
    assert call_replay.OUTCOMES["inference keys dropped: weights changed"] == 2


# ---------------------------------------------------------------------------------------------
# The bookkeeping of replays, on the CPU: ``cuda_ffn`` runs its kernels in Triton's interpreter,
# and a stand-in graph replays a recorded call by running its launches again on the graph's
# inputs and writing the results into the recorded result's tensors, as a CUDA graph writes into
# its fixed memory.
# ---------------------------------------------------------------------------------------------


def _as_captured(launches, *args):
    """``launches(*args)`` as a capture runs it: ``cuda_graphs.capturing()`` is true (nothing is
    cached per weight)."""
    from twell_compile.lowering import cuda_graphs

    with mock.patch.object(cuda_graphs, "capturing", lambda: True):
        return launches(*args)


class _StandInGraph:
    def __init__(self, run, result):
        self.run, self.result = run, result

    def replay(self):
        for fixed, fresh in zip(call_replay.tensors_of(self.result), call_replay.tensors_of(self.run())):
            fixed.copy_(fresh)


def _stand_in_record(layer, state, values, launches, extra, reads):
    inputs = tuple(v.clone() for v in values)
    result = _as_captured(launches, *inputs, *extra)
    recorded = call_replay.RecordedCall(_StandInGraph(lambda: _as_captured(launches, *inputs, *extra), result), inputs,
                                        result, reads)
    state.graphs.append(recorded)
    return recorded


class _Policy:
    """Stands in for ``LayerPolicy`` (whose counters copy needs pinned CUDA memory)."""

    calls = 0

    def after(self, *_):
        self.calls += 1

    def refresh(self):
        pass

    def expects_dense_rows(self, tokens, rows):
        return False


@pytest.fixture
def stand_in_replays(monkeypatch):
    """Replays on the CPU through ``_StandInGraph``, for layers 8_800-8_899."""
    from twell_compile.lowering import dispatch_policy

    monkeypatch.setattr(call_replay, "KEYS", type(call_replay.KEYS)())
    monkeypatch.setattr(call_replay, "TRAINING_FORWARDS", {})
    monkeypatch.setattr(call_replay, "OUTCOMES", type(call_replay.OUTCOMES)())
    monkeypatch.setattr(call_replay, "_record", _stand_in_record)
    monkeypatch.setattr(call_replay, "has_room", lambda device: True)
    monkeypatch.setattr(call_replay, "eligible", lambda x2d, hidden, layer, capturing, keep: (
        call_replay.ENABLED and 8_800 <= layer < 8_900 and not capturing and keep))
    for layer in range(8_800, 8_900):
        monkeypatch.setitem(dispatch_policy.POLICIES, (layer, 0), _Policy())
    monkeypatch.setattr(dispatch_policy, "WARM", set())
    return monkeypatch


def _ffn(seed=0, m=12, d=16, h=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g)
    wg, wu = torch.randn(h, d, generator=g) - 1.0, torch.randn(h, d, generator=g)  # mostly inactive gate
    return x, wg, wu, torch.randn(d, h, generator=g)


def _steps(layer, forwards, steps=4):
    """``steps`` sparse training steps through ``cuda_ffn`` (``forwards`` forwards, then their
    backwards in reverse order, then an SGD update): every step's outputs and gradients."""
    from twell_compile.lowering import cuda_ffn, force_path

    _, wg, wu, wd = _ffn()
    log = []
    with force_path("sparse"):
        for step in range(steps):
            xs = [_ffn(seed=10 * step + i + 1)[0] for i in range(forwards)]
            results = [cuda_ffn.forward(x, wg, wu, wd, None, None, None, layer=layer, training=True)[0] for x in xs]
            for x, res in reversed(list(zip(xs, results))):
                dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(step))
                grads = cuda_ffn.backward(dout, x, wg, wu, wd, None, None, None, res.packed, res.up_val,
                                          torch.tensor(0.01), layer=layer)
                log.append([res.out.clone(), grads.dx.clone(), grads.dwg.clone(), grads.dwu.clone(), grads.dwd.clone()])
                del grads
            del results, res
            for w, g in zip((wg, wu, wd), log[-1][2:]):
                w.sub_(0.1 * g)
    return log


@pytest.mark.parametrize("forwards", [1, 2])
def test_replayed_training_steps_pair_each_backward_with_its_forward(stand_in_replays, forwards):
    replayed = _steps(8_810 + forwards, forwards)
    keys = [(k, s) for k, s in call_replay.KEYS.items() if k[0] == 8_810 + forwards]
    graphs = [g for _, s in keys for g in s.graphs]
    assert len(graphs) == forwards, "a graph per forward held at once"
    assert all(any(b.graphs for b in g.backward.values()) for g in graphs if g.training)
    stand_in_replays.setattr(call_replay, "ENABLED", False)
    eager = _steps(8_850 + forwards, forwards)
    for step, (got, want) in enumerate(zip(replayed, eager)):
        for name, a, b in zip(("out", "dx", "dwg", "dwu", "dwd"), got, want):
            assert torch.equal(a, b), f"backward {step}: {name}"


def test_a_replayed_backward_reads_its_own_tokens(stand_in_replays):
    """Under torch.compile the backward's tokens may be recomputed rather than saved: a replayed
    backward copies in the tokens it is given, and its gradients are the eager backward's on them."""
    from twell_compile.lowering import cuda_ffn, force_path

    x, wg, wu, wd = _ffn()
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    nudged = x + 0.25
    grads = {}
    for replay in (True, False):
        stand_in_replays.setattr(call_replay, "ENABLED", replay)
        layer = 8_820 if replay else 8_821
        with force_path("sparse"):
            for call in range(4):  # eager (L1 measured), eager, recorded, replayed
                res = cuda_ffn.forward(x, wg, wu, wd, None, None, None, layer=layer, training=True)[0]
                assert (call_replay.training_forward(res.packed.count, x) is not None) == (replay and call >= 2)
                g = cuda_ffn.backward(dout, nudged, wg, wu, wd, None, None, None, res.packed, res.up_val,
                                      torch.tensor(0.01), layer=layer)
        grads[replay] = [t.clone() for t in (g.dx, g.dwg, g.dwu, g.dwd)]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_outcomes_say_why_calls_ran_eagerly_and_when_the_weights_moved(stand_in_replays):
    from twell_compile.lowering import cuda_ffn, force_path

    x, wg, wu, wd = _ffn()
    with force_path("sparse"):
        for call in range(5):
            if call == 4:  # the same values in new memory, as an autocast copy made anew
                wg, wu, wd = (w.clone() for w in (wg, wu, wd))
            res = cuda_ffn.forward(x, wg, wu, wd, None, None, None, layer=8_860, training=True)[0]
            cuda_ffn.backward(torch.ones_like(x), x, wg, wu, wd, None, None, None, res.packed, res.up_val,
                              torch.tensor(0.01), layer=8_860)
            del res  # a held result would make the next call record a graph of its own
    outcomes = call_replay.stats().outcomes
    # calls 0 (L1 measured) and 1: first calls of their keys; 2: recorded; 3: replayed; 4: new
    # weights, so the layer's graphs copy them in from now on, under a key of its own
    assert outcomes["forward eager: first call of its key"] == 3
    assert outcomes["forward replayed"] == 1 and outcomes["backward replayed"] == 1
    assert outcomes["layers whose training graphs copy the weights in"] == 1
    assert outcomes["training forwards from graphs"] == 2, "call 2 recorded, call 3 replayed"
    assert (8_860, 0) in call_replay.COPIED_WEIGHTS
    keys = [k for k in call_replay.KEYS if k[0] == 8_860]
    assert len(keys) == 1 and all(r[0] is None for r in keys[0][-1][0] if r is not None), "no pointers in its key"


@pytest.mark.parametrize("biases", [False, True])
def test_training_weights_made_anew_every_step_replay_from_copies(stand_in_replays, biases):
    """Autocast's weight copies are made anew each step, wherever the allocator puts them: once they
    moved, the layer's graphs copy the weights (and biases) in, so the calls replay, and each
    replayed step is the eager step on the weights it was given, its backward included."""
    from twell_compile.lowering import cuda_ffn, force_path

    stand_in_replays.setattr(call_replay, "COPIED_WEIGHTS", set())
    x, wg, wu, wd = _ffn()
    g0 = torch.Generator().manual_seed(3)
    bias = [torch.randn(n, generator=g0) for n in (wg.shape[0], wu.shape[0], wd.shape[0])] if biases else [None] * 3
    names = ("out", "dx", "dwg", "dwu", "dwd", "dbg", "dbu", "dbd")
    logs = {}
    for layer, replay in ((8_875 + 2 * biases, True), (8_876 + 2 * biases, False)):
        stand_in_replays.setattr(call_replay, "ENABLED", replay)
        log = logs[replay] = []
        params, held = [t.clone() for t in (wg, wu, wd, *bias) if t is not None], None
        with force_path("sparse"):
            for _ in range(10):
                copies = [p.clone() for p in params]  # the previous step's copies are still alive: new memory
                weights = copies + [None] * (6 - len(copies))
                res = cuda_ffn.forward(x, *weights, layer=layer, training=True)[0]
                g = cuda_ffn.backward(torch.ones_like(x), x, *weights, res.packed, res.up_val, torch.tensor(0.01),
                                      layer=layer)
                grads = [t for t in (g.dwg, g.dwu, g.dwd, g.dbg, g.dbu, g.dbd) if t is not None]
                log.append([res.out.clone(), g.dx.clone(), *(t.clone() for t in grads)])
                for p, grad in zip(params, grads):
                    p.sub_(1e-3 * grad)
                held = copies
                del res, g, grads
    del held
    outcomes = call_replay.stats().outcomes
    assert outcomes["forward replayed"] >= 5 and outcomes["backward replayed"] >= 5, outcomes
    assert outcomes["layers whose training graphs copy the weights in"] == 1
    for call, (got, want) in enumerate(zip(logs[True], logs[False])):
        assert len(got) == (8 if biases else 5)
        for name, a, b in zip(names, got, want):
            assert torch.isfinite(b).all() and torch.equal(a, b), f"call {call}: {name}"


def test_replayed_inference_calls_never_overwrite_held_outputs(stand_in_replays):
    from twell_compile.lowering import cuda_ffn, force_path

    _, wg, wu, wd = _ffn()
    xs = [_ffn(seed=s)[0] for s in range(6)]
    with torch.no_grad(), force_path("sparse"):
        outs = [cuda_ffn.forward(x, wg, wu, wd, None, None, None, layer=8_830, training=False)[0].out for x in xs]
        copies = [o.clone() for o in outs]
        for x, o in zip(xs, outs):  # each call's output, recorded, replayed or eager, is still its own
            want = cuda_ffn.forward(x, wg, wu, wd, None, None, None, layer=8_831, training=False)[0].out
            assert torch.equal(o, want)
        assert all(torch.equal(o, c) for o, c in zip(outs, copies))


def test_replayed_calls_under_the_full_token_count_take_the_captured_density_limit():
    from twell_compile.lowering import dispatch_policy as dp

    few = dp.SPARSE_FULL_TOKENS_CAPTURED - 1
    assert dp.density_limit(False, few) == min(dp.SPARSE_MAX_DENSITY["inference"], dp.SPARSE_MAX_DENSITY_FEW_TOKENS)
    assert dp.density_limit(True, dp.SPARSE_FULL_TOKENS_CAPTURED) == dp.SPARSE_MAX_DENSITY["training"]
    assert dp.density_limit(True) == dp.SPARSE_MAX_DENSITY["training"]
