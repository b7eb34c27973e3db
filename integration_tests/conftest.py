import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread per test module, restored afterwards.

    These models are small; on a shared 2-core CI machine the idle threads' spin-waiting
    made runs up to ~5x slower than a single thread.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
