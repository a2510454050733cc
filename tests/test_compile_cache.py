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
import platform
import shutil
import subprocess
import sys

import pytest

from simplefsdp.ir.hardware import CACHE_DIR, cpu_profile

# Two small sharded models with activation checkpointing, our passes on and off: forward and backward of each.
# With $START_TOGETHER (a directory), each process waits there for the other before compiling (after its
# imports, which take each process its own time).
COMPILE_BOTH = """
import json, os, time, torch
from torch._inductor import config, cpu_vec_isa
base_isa_checks = []  # Inductor's check of an ISA itself (its AVX test code), not of an extension like AVX512-BF16
check_build = cpu_vec_isa.VecISA.check_build
cpu_vec_isa.VecISA.check_build = lambda isa, code: (
    base_isa_checks.append(code == cpu_vec_isa.VecISA._avx_code), check_build(isa, code))[1]
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


if together := os.environ.get("START_TOGETHER"):
    open(os.path.join(together, str(os.getpid())), "w").close()
    while len(os.listdir(together)) < 2:
        time.sleep(0.05)
for options in ({}, {"buckets": None, "reorder": False}):
    torch.manual_seed(0)
    model = Model()
    simplefsdp.apply_activation_checkpointing(model.layers, "selective")
    simplefsdp.compile_sharded(model, **options)
    model(torch.randn(8, 16)).sum().backward()
isa = {"vec_isa_ok": config.cpp.vec_isa_ok, "base_isa_checks": sum(base_isa_checks),
       "picked_isa": str(cpu_vec_isa.pick_vec_isa())}
with config.patch({"cpp.vec_isa_ok": None}):  # Inductor's own choice from its checks (their first answers, cached)
    valid = cpu_vec_isa.valid_vec_isa_list.__wrapped__()
    isa["checked_isa"] = str(cpu_vec_isa.get_isa_from_cpu_capability(
        os.getenv("ATEN_CPU_CAPABILITY"), valid, cpu_vec_isa.invalid_vec_isa) if valid else cpu_vec_isa.invalid_vec_isa)
    flags = cpu_vec_isa.x86_isa_checker()
    isa["all_isas_usable"] = all(candidate for candidate in cpu_vec_isa.supported_vec_isa_list
                                 if all(flag in flags for flag in str(candidate).split()))
print(json.dumps({**counters["inductor"], **counters["aot_autograd"], **isa}))
os._exit(0)
"""


def compile_in_new_processes(cache_dir: str, count: int = 1, **env_vars: str) -> list[dict[str, int]]:
    """The compile caches' counters of ``count`` processes compiling COMPILE_BOTH at the same time (and what they
    did about the CPU's vector ISAs)."""
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
    simplefsdp_cache = tmp_path_factory.mktemp("simplefsdp_cache")  # no ISA marker yet; the CPU profile, if measured
    for profile in CACHE_DIR.glob("cpu-*.json"):
        shutil.copy(profile, simplefsdp_cache)
    return {
        "cold": compile_in_new_process(cache_dir, SIMPLEFSDP_CACHE=str(simplefsdp_cache)),
        "warm": compile_in_new_process(cache_dir, SIMPLEFSDP_CACHE=str(simplefsdp_cache)),
        "warm_fx_only": compile_in_new_process(cache_dir, TORCHINDUCTOR_AUTOGRAD_CACHE="0",
                                               SIMPLEFSDP_CACHE=str(simplefsdp_cache)),
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


def test_a_warm_process_does_not_check_the_cpu_s_vector_isas_again(processes):
    """Inductor checks each vector ISA by building and loading a test library in a child process, 1.4 s at every
    start; once they all passed on this machine (``runtime/cpu_isa.py``), a later process skips those checks and picks
    the ISA that the checks picked (the warm cache hits above show the compile's configuration did not change)."""
    cold, warm = processes["cold"], processes["warm"]
    if platform.machine() != "x86_64" or not cold["all_isas_usable"]:  # not x86-64, or a check failed: as Inductor
        assert cold["vec_isa_ok"] is None and warm["vec_isa_ok"] is None, (cold, warm)
        return
    assert cold["vec_isa_ok"] is True and warm["vec_isa_ok"] is True, (cold, warm)
    assert warm["base_isa_checks"] == 0 and cold["base_isa_checks"] > 0, (cold, warm)
    assert warm["picked_isa"] == cold["picked_isa"] == cold["checked_isa"], (cold, warm)


def test_a_failed_isa_check_is_not_recorded(tmp_path, monkeypatch):
    """Where one of the CPU's ISAs fails Inductor's check, nothing is recorded and Inductor keeps checking."""
    from torch._inductor import config

    from simplefsdp.runtime import cpu_isa

    class Isa:
        def __init__(self, name: str, usable: bool) -> None:
            self.name, self.usable, self.checks = name, usable, 0

        def __str__(self) -> str:
            return self.name

        def __bool__(self) -> bool:
            self.checks += 1
            return self.usable

    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_isa.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_isa, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(cpu_isa, "x86_isa_checker", lambda: ["avx2", "avx512"])
    # avx512 fails: nothing recorded; both pass: recorded after checking; then: recorded, nothing checked
    for usable, recorded, checks in ((False, None, [1, 0, 0]), (True, True, [1, 1, 0]), (True, True, [0, 0, 0])):
        isas = [Isa("avx512", usable), Isa("avx2", True), Isa("amx_tile", False)]  # amx_tile: not this CPU's
        monkeypatch.setattr(cpu_isa, "supported_vec_isa_list", isas)
        with config.patch({"cpp.vec_isa_ok": None}):
            cpu_isa.check_vector_isas_once_per_machine()
            assert config.cpp.vec_isa_ok is recorded
        assert [isa.checks for isa in isas] == checks
        assert len(list(tmp_path.glob("vec-isa-*"))) == (recorded is True)


def test_two_processes_compiling_at_once_compile_each_graph_once(tmp_path):
    """Like 2 ranks of a host: both start compiling the same 2 Dynamo graphs (4 Inductor graphs) together on an empty
    cache; each Dynamo graph is compiled once, and the other process loads it from AOTAutograd's cache instead of
    tracing its joint graph. These graphs are too small to show our lock at work: on 2 cores one process reached
    each compile after the other had finished it, with the lock or without (`runtime/compile.py`); the lock's effect
    on 2 ranks of a real model is measured in ARCHITECTURE.md."""
    (tmp_path / "start").mkdir()
    # Both plan "auto" buckets on one cached CPU profile, as the ranks of a host do (rank 0's, broadcast). With none
    # cached, each would measure its own at the same time, on cores the other loads, plan other buckets, and
    # compile graphs of its own (6 FX graph misses, seen beside another test file on cold caches).
    cpu_profile()
    counters = compile_in_new_processes(str(tmp_path / "cache"), 2, START_TOGETHER=str(tmp_path / "start"))
    assert sum(c.get("fxgraph_cache_miss", 0) for c in counters) == 4, counters
    assert sum(c.get("autograd_cache_miss", 0) for c in counters) == 2, counters
    assert sum(c.get("autograd_cache_hit", 0) for c in counters) == 2, counters



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


def test_a_loaded_graph_makes_its_zeros_instead_of_holding_them():
    """torch rebuilds a pickled GraphModule (a cached compiled-once block's backward) by tracing its code: a factory
    call (the zeros a slice's backward scatters into) ran for real there and the loaded graph held the tensor."""
    import pickle

    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from simplefsdp.runtime.graph_loading import trace_ops_without_proxies_on_load

    def scatter_into_zeros(x):
        return torch.slice_scatter(torch.zeros(4, 8), x, 1, 0, None, 2)

    graph = make_fx(scatter_into_zeros)(torch.randn(4, 4))
    trace_ops_without_proxies_on_load()
    loaded = pickle.loads(pickle.dumps(graph))
    assert dict(loaded.named_buffers()) == {}
    assert [node.target for node in loaded.graph.nodes if node.op == "call_function"] == [
        torch.ops.aten.zeros.default, torch.ops.aten.slice_scatter.default]
    x = torch.randn(4, 4)
    assert torch.equal(loaded(x), scatter_into_zeros(x))  # the same ops on the same values: bitwise
    assert loaded.graph._tracer_cls is graph.graph._tracer_cls  # pickles again as the graph it was loaded from
