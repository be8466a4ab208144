import os

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.threads import single_thread

# Tests must never try to reach wandb's servers, and share one tokenization cache per checkout.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("ASYNCPP_CACHE", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache", "asyncpp"))


@pytest.fixture
def one_thread():
    """torch at 1 intra-op thread for the test, restored after. Modules that compare floats bit for bit
    (they depend on the matmul blocking) or spawn gloo ranks onto the 2 cores use it module-wide via
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    with single_thread():
        yield


@pytest.fixture
def fake_world():
    """A 4-rank fake process group seen from rank 3 (what a dry run uses); torn down afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()
