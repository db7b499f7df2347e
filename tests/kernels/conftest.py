import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These tensors are tiny: intra-op threads only add overhead, and on a loaded 2-core CI box
    oversubscription made index_add_ ~50x slower. Restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
