"""kernels/fired_neurons.py and reference.fired_neurons: the neurons a TwELL buffer says fired.

Oracle: from the dense pre-activation, a neuron fired when some row has it active, and every
neuron of a tile that overflowed in some row counts as fired (its row kept only its first entries).
On CPU the kernel runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.strategies import pre_activations  # noqa: E402
from twell_compile.kernels import reference as R  # noqa: E402
from twell_compile.kernels import stamp_fired  # noqa: E402
from twell_compile.kernels.format import TwellLayout, empty_packed, is_active  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _fired_oracle(pre: torch.Tensor, layout: TwellLayout) -> torch.Tensor:
    m, h = pre.shape
    n_tiles = layout.n_tiles(h)
    active = torch.zeros(m, n_tiles * layout.tile_n, dtype=torch.bool)
    active[:, :h] = is_active(pre)
    per_tile = active.view(m, n_tiles, layout.tile_n).sum(-1)
    overflowed = (per_tile > layout.slots).any(0)
    return active[:, :h].any(0) | overflowed.repeat_interleave(layout.tile_n)[:h]


def _buffer(pre: torch.Tensor, layout: TwellLayout, paired: bool, gen: torch.Generator):
    """``pre`` packed into a fresh (paired or separate) buffer whose slots past the stored ones
    hold junk columns, out of range too: a reader of them would stamp the wrong neurons."""
    ref = R.pack_ref(pre, layout)
    m, h = pre.shape
    packed = empty_packed(m, h, torch.float32, DEV, layout, paired=paired)
    junk = torch.randint(-(h // 4) - 1, h + h // 4 + 1, ref.idx.shape, generator=gen, dtype=torch.int32)
    packed.idx.copy_(torch.where(ref.stored_mask(), ref.idx, junk))
    packed.val.copy_(ref.val.float())
    packed.count.copy_(ref.count)
    return packed


@given(case=pre_activations(max_m=140), paired=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_stamp_fired_stamps_exactly_the_fired_neurons(case, paired, seed):
    pre, layout = case
    gen = torch.Generator().manual_seed(seed)
    m, h = pre.shape
    packed = _buffer(pre, layout, paired, gen)
    want = _fired_oracle(pre, layout)
    assert torch.equal(R.fired_neurons(packed, h, layout).cpu(), want)

    before = torch.rand(h, generator=gen, dtype=torch.float64)
    stamps = before.to(DEV)
    now = torch.tensor([7.0], dtype=torch.float64, device=DEV)
    stamp_fired(packed, stamps, now, layout=layout)
    assert torch.equal(stamps.cpu(), torch.where(want, 7.0, before))


def test_stamp_fired_names_what_does_not_fit():
    packed = empty_packed(4, 300, torch.float32, DEV)
    packed.count.zero_()
    now = torch.zeros(1, dtype=torch.float64, device=DEV)
    with pytest.raises(ValueError, match="does not cover 200 neurons"):
        stamp_fired(packed, torch.zeros(200, dtype=torch.float64, device=DEV), now)
    with pytest.raises(ValueError, match="now one torch.float32 value"):
        stamp_fired(packed, torch.zeros(300, dtype=torch.float32, device=DEV), now)
    stamps = torch.zeros(300, dtype=torch.float64, device=DEV)
    stamp_fired(packed, stamps, now)  # nothing active: nothing stamped
    assert not stamps.any()


@pytest.mark.parametrize("paired", [False, True])
def test_a_slot_past_the_stored_ones_is_never_read(paired):
    """Tile 0 of row 0 overflows (4 actives, 3 slots); tile 1 has none, and its slots hold neuron
    5's column: neuron 5 did not fire, whatever the slots say."""
    layout = TwellLayout(tile_n=4, slots=3)
    pre = -torch.ones(2, 8)
    pre[0, :4] = 1.0
    packed = _buffer(pre, layout, paired, torch.Generator().manual_seed(0))
    packed.idx[:, 1].fill_(5)
    stamps = torch.zeros(8, dtype=torch.float64, device=DEV)
    stamp_fired(packed, stamps, torch.ones(1, dtype=torch.float64, device=DEV), layout=layout)
    assert stamps.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.gpu
@pytest.mark.parametrize("paired", [False, True])
def test_gpu_stamp_fired_at_a_model_shape(paired):
    """16384 tokens of a 768-wide model's 2048 neurons at 0.5%, with rows overflowing a tile."""
    gen = torch.Generator().manual_seed(3)
    pre = torch.where(torch.rand(16384, 2048, generator=gen) < 0.005, 1.0, -1.0)
    pre[::997, 256:256 + 40] = 1.0  # 17 rows overflow tile 2
    layout = TwellLayout()
    packed = _buffer(pre, layout, paired, gen)
    want = _fired_oracle(pre, layout)
    stamps = torch.zeros(2048, dtype=torch.float64, device=DEV)
    stamp_fired(packed, stamps, torch.full((1,), 3.0, dtype=torch.float64, device=DEV), layout=layout)
    assert torch.equal(stamps.cpu(), torch.where(want, 3.0, 0.0).double())
    assert torch.equal(R.fired_neurons(packed, 2048, layout).cpu(), want)


@pytest.mark.gpu
def test_gpu_stamp_fired_is_one_binary_warmed_before_a_capture_records_it():
    """``warm_stamp_fired`` compiles the only binary: a call of another shape compiles nothing, so
    one inside a CUDA-graph capture records the kernel, and the replay stamps."""
    from twell_compile.kernels.fired_neurons import _stamp_fired_kernel, warm_stamp_fired

    warm_stamp_fired(DEV)
    binaries = _stamp_fired_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(binaries)
    layout = TwellLayout()
    pre = torch.where(torch.rand(333, 1000, generator=torch.Generator().manual_seed(1)) < 0.01, 1.0, -1.0)
    packed = _buffer(pre, layout, False, torch.Generator().manual_seed(2))
    stamps = torch.zeros(1000, dtype=torch.float64, device=DEV)
    now = torch.full((1,), 5.0, dtype=torch.float64, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stamp_fired(packed, stamps, now, layout=layout)
    assert len(binaries) == compiled, "no new specialization"
    assert not stamps.any(), "captured, not run"
    graph.replay()
    assert torch.equal(stamps.cpu(), torch.where(_fired_oracle(pre, layout), 5.0, 0.0).double())
