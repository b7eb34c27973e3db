import os
import sys

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models are dominated by thread synchronisation: on a busy 2-core machine two
    intra-op threads make each forward ~100x slower than one thread does. A module opts
    in with ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def logged_warnings():
    """The loguru messages of level WARNING and above logged during the test."""
    from loguru import logger

    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    yield messages
    logger.remove(sink)
