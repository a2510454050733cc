"""Cold and warm first step of ``cpu-small``: simplefsdp with passes on and off, and torchtitan's SimpleFSDP.

    python benchmarks/compile_time.py --repeats 3 --out benchmarks/compile_time_cpu-small.md

Each repeat gives every contender an empty Inductor cache directory and runs
two fresh processes on it in turn: the first compiles cold (Dynamo,
AOTAutograd, our passes when on, Inductor code generation, C++ compilation),
the second is a restart and should load both graphs from the caches. A run
shards cpu-small over a fake process group of 2 ranks in one process (the
graphs of a 2-rank gloo run; the collectives move no data) and times its first
forward and backward. The torchtitan row needs ``pip install --no-deps
torchtitan==0.3.0`` (its ``graph_trainer/simple_fsdp.py``, compiled whole with
``torch.compile``); it is left out when that is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

CONTENDERS = ("passes-on", "passes-off", "torchtitan")


def torchtitan_data_parallel():
    """torchtitan's SimpleFSDP ``data_parallel``; its module base class (torchtitan's config system) as
    ``nn.Module``."""
    from torch import nn

    shim = types.ModuleType("torchtitan.protocols.module")
    shim.Module = nn.Module
    sys.modules["torchtitan.protocols.module"] = shim
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    return data_parallel


def one_run(contender: str) -> dict:
    """Time the first step of cpu-small in this process under ``contender``; count the cache lookups."""
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp import compile_sharded
    from simplefsdp.models.llama import build_model
    from simplefsdp.passes.install import OverlapPasses
    from simplefsdp.runtime.fake_world import fake_world

    pass_seconds = []
    original = OverlapPasses.__call__

    def timed(self, graph):
        start = time.perf_counter()
        original(self, graph)
        pass_seconds.append(time.perf_counter() - start)

    OverlapPasses.__call__ = timed
    with fake_world(2):
        torch.manual_seed(0)
        model = build_model("cpu-small")
        mesh = init_device_mesh("cpu", (2,))
        if contender == "torchtitan":
            model = torch.compile(torchtitan_data_parallel()(model, mesh, mode="fully_shard"))
        else:
            passes = contender == "passes-on"
            compile_sharded(model, mesh=mesh, buckets="auto" if passes else None, reorder=passes)
        tokens = torch.randint(0, model.config.vocab_size, (4, 129))
        start = time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        first_step = time.perf_counter() - start
    return {"contender": contender, "first_step_s": first_step, "pass_s": sum(pass_seconds),
            "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
            "aot_hits": counters["aot_autograd"]["autograd_cache_hit"]}


def measure(repeats: int, contenders: list[str]) -> list[dict]:
    """Per repeat and contender: a cold and a warm process on one fresh Inductor cache directory."""
    runs = []
    for index in range(repeats):
        for contender in contenders[index % len(contenders):] + contenders[:index % len(contenders)]:
            with tempfile.TemporaryDirectory() as cache:
                for start in ("cold", "warm"):
                    argv = [sys.executable, __file__, "--one", contender]
                    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                    output = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
                    runs.append({**json.loads(output.strip().splitlines()[-1]), "start": start})
                    print(runs[-1], flush=True)
    return runs


def table(runs: list[dict], contenders: list[str]) -> str:
    """Median cold and warm first step per contender, the cache hits of the warm runs, as a markdown table."""
    lines = ["| contender | runs | cold first step, median s | warm first step, median s | warm / cold | "
             "warm FX graph cache hits | warm AOTAutograd cache hits | time inside OverlapPasses (cold), median s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for contender in contenders:
        cold = [run for run in runs if run["contender"] == contender and run["start"] == "cold"]
        warm = [run for run in runs if run["contender"] == contender and run["start"] == "warm"]
        cold_s = statistics.median(run["first_step_s"] for run in cold)
        warm_s = statistics.median(run["first_step_s"] for run in warm)
        passes = f"{statistics.median(run['pass_s'] for run in cold):.2f}" if contender == "passes-on" else "-"
        lines.append(f"| {contender} | {len(cold)} | {cold_s:.1f} | {warm_s:.1f} | {warm_s / cold_s:.2f} | "
                     f"{'/'.join(str(run['fx_hits']) for run in warm)} | "
                     f"{'/'.join(str(run['aot_hits']) for run in warm)} | {passes} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="cold + warm pairs per contender")
    parser.add_argument("--out", default=None, help="also write the table here")
    parser.add_argument("--one", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one)))
        os._exit(0)  # skip gloo/fake-group static destructors, as simplefsdp train does
    contenders = [name for name in CONTENDERS if name != "torchtitan" or importlib.util.find_spec("torchtitan")]
    text = table(measure(args.repeats, contenders), contenders)
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
