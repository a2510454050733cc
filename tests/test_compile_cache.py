"""Restarts are warm: a second process compiling the same sharded model loads its graphs from the caches; two
processes compiling it at once compile each graph once.

Every restart, resume and healing replica group depends on this. The sharded parameters bring their
``DeviceMesh`` into the graphs as inputs, which PyTorch 2.13 keyed by a per-process hash (a miss in
every process); the gather region's checkpoint context had no ``cache_hash`` (AOTAutograd bypassed its
cache). This is a behaviour, so the test counts cache hits; it times nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Two small sharded models with activation checkpointing, our passes on and off: forward and backward of each.
# With $START_TOGETHER (a directory), each process waits there for the other before compiling.
COMPILE_BOTH = """
import json, os, time, torch
if together := os.environ.get("START_TOGETHER"):
    open(os.path.join(together, str(os.getpid())), "w").close()
    while len(os.listdir(together)) < 2:
        time.sleep(0.05)
from torch import nn
from torch._dynamo.utils import counters
import simplefsdp

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


for options in ({}, {"buckets": None, "reorder": False}):
    torch.manual_seed(0)
    model = Model()
    simplefsdp.apply_activation_checkpointing(model.layers, "selective")
    simplefsdp.compile_sharded(model, **options)
    model(torch.randn(8, 16)).sum().backward()
print(json.dumps({**counters["inductor"], **counters["aot_autograd"]}))
os._exit(0)
"""


def compile_in_new_processes(cache_dir: str, count: int = 1, **env_vars: str) -> list[dict[str, int]]:
    """The compile caches' counters of ``count`` processes compiling COMPILE_BOTH at the same time."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, **env_vars}
    processes = [subprocess.Popen([sys.executable, "-c", COMPILE_BOTH], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(count)]
    counters = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        counters.append(json.loads(stdout.strip().splitlines()[-1]))
    return counters


def compile_in_new_process(cache_dir: str, **env_vars: str) -> dict[str, int]:
    return compile_in_new_processes(cache_dir, **env_vars)[0]


@pytest.fixture(scope="module")
def processes(tmp_path_factory) -> dict[str, dict[str, int]]:
    """Counters of three processes in turn on one cache directory: a cold one, a warm one, and a warm one
    with AOTAutograd's cache off (so Inductor's FX graph cache is looked up by its own key, as it is
    whenever AOTAutograd bypasses its cache, e.g. for a checkpoint policy of the user's without a cache_hash)."""
    cache_dir = str(tmp_path_factory.mktemp("inductor_cache"))
    return {
        "cold": compile_in_new_process(cache_dir),
        "warm": compile_in_new_process(cache_dir),
        "warm_fx_only": compile_in_new_process(cache_dir, TORCHINDUCTOR_AUTOGRAD_CACHE="0"),
    }


def test_first_process_compiles_every_graph(processes):
    cold = processes["cold"]
    assert cold.get("fxgraph_cache_miss") == 4 and cold.get("fxgraph_cache_hit", 0) == 0, cold


def test_second_process_hits_the_aot_autograd_cache(processes):
    warm = processes["warm"]
    assert warm.get("autograd_cache_hit") == 2, warm
    assert warm.get("autograd_cache_bypass", 0) == 0 and warm.get("autograd_cache_miss", 0) == 0, warm
    assert warm.get("fxgraph_cache_hit") == 4 and warm.get("fxgraph_cache_miss", 0) == 0, warm


def test_second_process_hits_the_fx_graph_cache(processes):
    warm = processes["warm_fx_only"]
    assert warm.get("fxgraph_cache_hit") == 4 and warm.get("fxgraph_cache_miss", 0) == 0, warm


def test_two_processes_compiling_at_once_compile_each_graph_once(tmp_path):
    """Like 2 ranks of a host: both start compiling the same 4 graphs together on an empty cache; for each graph one
    compiles while the other waits on the graph's lock and then loads it (without the lock both compile all 4)."""
    (tmp_path / "start").mkdir()
    counters = compile_in_new_processes(str(tmp_path / "cache"), 2, START_TOGETHER=str(tmp_path / "start"))
    assert sum(c.get("fxgraph_cache_miss", 0) for c in counters) == 4, counters



def _on_fake_rank(rank: int, mesh_shape: tuple[int, int], key_of_mesh) -> object:
    """``key_of_mesh(mesh)`` on ``rank`` of a fake world with a ``(replicate, shard)`` mesh of ``mesh_shape``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=mesh_shape[0] * mesh_shape[1], store=FakeStore())
    try:
        return key_of_mesh(init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")))
    finally:
        dist.destroy_process_group()


def test_ranks_in_different_groups_of_a_2d_mesh_get_different_cache_keys():
    """The graph of a hybrid_shard rank holds its own groups' names: a rank of another shard group must not load it."""
    from types import SimpleNamespace

    from simplefsdp.runtime.compile import _reduce_mesh_by_value

    # mesh (2, 2): ranks 0 and 1 share a shard group, rank 2 is in the other one
    keys = {rank: _on_fake_rank(rank, (2, 2), lambda mesh: (mesh._stable_hash(),
                                                        _reduce_mesh_by_value(None, SimpleNamespace(real_obj=mesh))))
            for rank in (0, 1, 2)}
    assert len({stable for stable, _ in keys.values()}) == 1  # the mesh alone is the same on every rank
    assert keys[2][1] != keys[0][1]


def test_ranks_with_uneven_shards_get_different_aotautograd_cache_keys():
    """A parameter of 3 rows on 2 ranks has shards of 2 and 1 rows: each rank's graph takes its own shard's shape.

    PyTorch's own DTensor key (global shape and placements) is the same on both ranks, so a restarted rank loaded
    the other rank's graph from a warm cache and failed on "expected size 2==1"."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from simplefsdp.runtime.compile import _reduce_dtensor_with_local_shard

    def keys(mesh):
        local = torch.zeros(2 - mesh.get_coordinate()[1], 7)
        param = DTensor.from_local(local, mesh["shard"], [Shard(0)], shape=torch.Size((3, 7)), stride=(7, 1))
        return param._stable_hash_for_caching(), _reduce_dtensor_with_local_shard(None, param)

    (torch_rank0, ours_rank0), (torch_rank1, ours_rank1) = (_on_fake_rank(rank, (1, 2), keys) for rank in (0, 1))
    assert torch_rank0 == torch_rank1
    assert ours_rank0 != ours_rank1
