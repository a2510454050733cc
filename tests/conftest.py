import pytest
import torch.distributed as dist
from ranks import apply_simulated_simdlen
from torch.testing._internal.distributed.fake_pg import FakeStore

apply_simulated_simdlen()


@pytest.fixture
def fake_world():
    """A fake process group of 8 ranks in this process: collectives do nothing."""
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    yield
    dist.destroy_process_group()
