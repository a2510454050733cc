import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_world():
    """A fake process group of 8 ranks in this process: collectives do nothing."""
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    yield
    dist.destroy_process_group()
