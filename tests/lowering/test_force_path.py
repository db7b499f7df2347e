"""``force_path``: the scoped switch that makes every CUDA call of the ops take one path.

The CUDA orchestration (``cuda_ffn.forward``) runs here on CPU tensors, its kernels in Triton's
interpreter, with a stand-in for the layer's policy (the real one copies counters to pinned
memory: CUDA only).
"""

import pytest
import torch

import twell_compile.lowering as lowering
from twell_compile.lowering import cuda_ffn, dispatch_policy, force_path


def test_force_path_validates_its_argument_when_called():
    for bad in ("Sparse", "auto", None, ""):
        with pytest.raises(ValueError, match=r"'sparse' or 'dense'"):
            force_path(bad)
    assert dispatch_policy.FORCED_PATH is None


def test_force_path_is_scoped_nests_and_is_restored_when_the_block_raises():
    assert dispatch_policy.FORCED_PATH is None
    with force_path("sparse"):
        assert dispatch_policy.FORCED_PATH == "sparse"
        with force_path("dense"):
            assert dispatch_policy.FORCED_PATH == "dense"
        assert dispatch_policy.FORCED_PATH == "sparse"
    assert dispatch_policy.FORCED_PATH is None
    with pytest.raises(RuntimeError, match="boom"), force_path("dense"):
        raise RuntimeError("boom")
    assert dispatch_policy.FORCED_PATH is None


class _Policy:
    """Stands in for ``LayerPolicy``: it would choose dense (unmeasured), and records nothing."""

    calls = 1

    def after(self, *_):
        pass

    def choose(self, training):
        return False

    def choose_captured(self, training, tokens):
        return False

    def refresh(self):
        pass


@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_a_forced_call_takes_that_path_and_the_policy_is_back_afterwards(monkeypatch, path):
    layer = 8_890
    monkeypatch.setitem(dispatch_policy.POLICIES, (layer, 0), _Policy())
    monkeypatch.setattr(dispatch_policy, "WARM", set())  # what the forced sparse call warms stays here
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=g)
    wg, wu = torch.randn(40, 16, generator=g), torch.randn(40, 16, generator=g)
    wd = torch.randn(16, 40, generator=g)
    call = lambda x, wg, wu, wd: cuda_ffn.forward(x, wg, wu, wd, None, None, None, layer=layer, training=False)  # noqa: E731
    with force_path(path):
        res, sparse = call(x, wg, wu, wd)
        assert sparse == (path == "sparse")
        _, sparse64 = call(x.double(), wg.double(), wu.double(), wd.double())
        assert not sparse64, "float64 inputs always take the dense path"
    want = torch.relu(x @ wg.T) * (x @ wu.T) @ wd.T
    assert torch.allclose(res.out, want, rtol=1e-4, atol=1e-4)
    assert not call(x, wg, wu, wd)[1], "outside the block the policy chooses (dense here)"


def test_the_package_exports_what_twell_compile_uses():
    expected = {"DEFAULT_LAYOUT", "TILE_N", "active_pairs", "ffn", "ffn_bwd", "ffn_train", "force_path", "gather_floor",
                "l1_snapshot", "mark_cuda_graph_layers", "mark_gathered_weight_layers", "prefers_sparse", "replay_stats", "replays_off",
                "telemetry",
                "tuned_configs", "first_launches", "watch_counters"}
    assert set(lowering.__all__) == expected
    assert all(getattr(lowering, name) is not None for name in expected)


def test_prefers_sparse_takes_in_the_counters_before_it_decides(monkeypatch):
    """A layer that ran compiled dense code (the backend's dense variant) has no op call to take
    its counters in: prefers_sparse must, or it never sees a measured density (as it once did not,
    on the H200: 0% of layers preferred sparse at 0.5% density)."""
    from twell_compile.lowering import dispatch_policy

    class Policy:
        measured, tokens = False, 16384

        def refresh(self):
            self.measured = True

        def choose(self, training):
            return True

        def choose_captured(self, training, tokens):
            return tokens == 16384

    monkeypatch.setattr(dispatch_policy, "layer_policy", lambda *args, **kwargs: Policy())
    device = torch.device("cuda", 0)
    assert dispatch_policy.prefers_sparse(0, device, True, cuda_graphs=False)
    assert dispatch_policy.prefers_sparse(0, device, True, cuda_graphs=True)
