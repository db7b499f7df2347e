"""kernels/neuron_major.py: the stored pairs grouped by neuron, and the neurons by pair count.

Oracles: a stable ``torch.argsort`` of the slots by neuron (the lists, their pointers and their
capacity), and the pair counts (each program's share of the neuron order, by decreasing count).
On CPU the kernels run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():  # before the kernel modules are imported (docs/architecture.md, 'Testing')
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.strategies import EDGE_H, densities, sizes  # noqa: E402
from twell_compile.kernels import reference as R  # noqa: E402
from twell_compile.kernels.format import DEFAULT_LAYOUT, TwellLayout, TwellPacked  # noqa: E402
from twell_compile.kernels.neuron_major import RANK_TB, neuron_major  # noqa: E402

NM = importlib.import_module("twell_compile.kernels.neuron_major")  # the module itself: a test patches ORDER_BLOCK
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _stored_sparse(packed: TwellPacked, dense_rows: torch.Tensor) -> torch.Tensor:
    return packed.stored_mask() & ~dense_rows.view(-1, 1, 1)


@st.composite
def packed_cases(draw):
    layout = draw(st.one_of(st.just(DEFAULT_LAYOUT),
                            st.builds(lambda t, f: TwellLayout(tile_n=t, slots=max(1, round(f * t))),
                                      st.sampled_from([2, 16, 64]), st.floats(0.0, 1.0))))
    m = draw(sizes(1, 130, (1, 63, 64, 65, 128, 129)))
    h = draw(sizes(1, 300, EDGE_H))
    density = draw(densities())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    pre = torch.where(torch.rand(m, h, generator=gen) < density, 1.0, -1.0)
    dense = torch.rand(m, generator=gen) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    return R.pack_ref(pre, layout), dense, h, layout


def _check_neuron_major(packed, dense, h, layout):
    packed = TwellPacked(*(t.to(DEV) for t in packed))
    dense = dense.to(DEV)
    ptr, slots, neurons = neuron_major(packed, dense, h, layout=layout)
    keys = torch.where(_stored_sparse(packed, dense), packed.idx.long(), h).reshape(-1)
    order = torch.argsort(keys, stable=True)
    n_pairs = int((keys < h).sum())
    counts = torch.bincount(keys, minlength=h + 1)[:h]
    expect_ptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    assert torch.equal(ptr.cpu(), expect_ptr.cpu())
    assert torch.equal(slots[:n_pairs].long().cpu(), order[:n_pairs].cpu())
    assert slots.numel() >= packed.idx.numel()  # capacity: every slot
    _check_neuron_order(neurons.cpu(), counts.cpu())


def _check_neuron_order(neurons, counts):
    """``neurons``: every neuron once; each program's strided share by decreasing pair count, so
    exactly decreasing when one program sorts them all."""
    h = counts.numel()
    assert neurons.dtype == torch.int32
    assert torch.equal(neurons.long().sort().values, torch.arange(h))
    n_chunks = -(-h // NM.ORDER_BLOCK)  # as patched, if it is
    for c in range(n_chunks):
        share = counts[neurons[c::n_chunks].long()]
        assert torch.equal(neurons[c::n_chunks].long() % n_chunks, torch.full_like(share, c))
        assert bool((share[:-1] >= share[1:]).all())


@given(case=packed_cases())
def test_neuron_major_is_a_stable_sort_by_neuron(case):
    """Neuron j's list is its stored pairs of the sparse rows, in token order."""
    _check_neuron_major(*case)


def test_neuron_order_in_several_chunks():
    """Above ``ORDER_BLOCK`` neurons each program sorts a strided share; the order is still a
    permutation with every share by decreasing count (skewed counts, H not a multiple of the chunks)."""
    gen = torch.Generator().manual_seed(1)
    h = 45
    rate = torch.rand(h, generator=gen) ** 3
    pre = torch.where(torch.rand(40, h, generator=gen) < rate, 1.0, -1.0)
    dense = torch.zeros(40, dtype=torch.bool)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NM, "ORDER_BLOCK", 8)
        _check_neuron_major(R.pack_ref(pre, DEFAULT_LAYOUT), dense, h, DEFAULT_LAYOUT)


def test_neuron_major_across_token_blocks():
    """Ranks come from each block's token bits (``RANK_TB`` tokens, up to 64 bits): neurons that
    every token holds, across several blocks and a partial last one, with dense rows among them,
    and small layouts (several tiles per row)."""
    gen = torch.Generator().manual_seed(0)
    m = 2 * RANK_TB + 7
    for layout, h, rate in ((DEFAULT_LAYOUT, 260, 0.1), (TwellLayout(tile_n=16, slots=3), 40, 0.15)):
        pre = torch.where(torch.rand(m, h, generator=gen) < rate, 1.0, -1.0)
        pre[:, 3] = 1.0  # a neuron in every token: rank = the token's place in its block
        pre[RANK_TB - 1:RANK_TB + 1, 5] = 1.0  # the last token of a block and the first of the next
        dense = torch.rand(m, generator=gen) < 0.2
        dense[RANK_TB - 1] = False
        _check_neuron_major(R.pack_ref(pre, layout), dense, h, layout)
