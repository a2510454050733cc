import pytest
import torch.distributed as dist
from ranks import apply_simulated_simdlen
from torch.testing._internal.distributed.fake_pg import FakeStore

apply_simulated_simdlen()

# The files that take longest (their tests' setup and call times summed, from `--durations` of a cold run on 2 cores,
# 2026-11-27), run first: with one file per pytest-xdist worker at a time (dev.py: -n 2 --dist loadfile
# --no-loadscope-reorder) the workers then finish together instead of one running a long file alone at the end.
LONGEST_FIRST = ("test_parity.py", "test_zoo.py", "test_semi_sync.py", "test_rank_invariance.py",
                 "test_activation_checkpointing.py", "test_shared_weights.py", "test_grad_accumulation.py",
                 "test_dynamic_shapes.py", "test_fault_tolerance.py", "test_train_cli.py", "test_readme.py",
                 "test_tensor_parallel.py", "test_quantize.py", "test_bench.py", "test_first_run.py",
                 "test_compile_cache.py", "test_precompile.py", "test_block_regions.py", "test_galore.py",
                 "test_rank_agreement.py", "test_checkpoint.py", "test_cli.py", "test_inspect.py")


def pytest_collection_modifyitems(items):
    """Order the files longest first (LONGEST_FIRST, then the rest as collected); tests keep their order in a file."""
    position = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: position.get(item.path.name, len(position)))


@pytest.fixture
def fake_world():
    """A fake process group of 8 ranks in this process: collectives do nothing."""
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    yield
    dist.destroy_process_group()
