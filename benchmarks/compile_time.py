"""Cold compile time of ``cpu-small`` with our passes on and off, side by side.

    python benchmarks/compile_time.py --repeats 4 --out benchmarks/compile_time_cpu-small.md

Each run is a fresh process with an empty Inductor cache directory, so the
first step is a cold compile: Dynamo, AOTAutograd, our passes (when on),
Inductor code generation and C++ compilation. The model is sharded over a fake
process group of 2 ranks in one process (the graphs are those of a 2-rank gloo
run; the collectives move no data). A run times its first forward and backward
and, separately, the time spent inside ``OverlapPasses`` (both graphs). Runs
alternate on/off, swapping which goes first in each pair; the table reports
medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def one_run(passes: bool) -> dict:
    """Time one cold first step of cpu-small in this process; ``passes`` toggles bucketing and reordering."""
    import torch
    import torch.nn.functional as F
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
        options = dict(buckets="auto", reorder=True) if passes else dict(buckets=None, reorder=False)
        compile_sharded(model, mesh=init_device_mesh("cpu", (2,)), **options)
        tokens = torch.randint(0, model.config.vocab_size, (4, 129))
        start = time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        first_step = time.perf_counter() - start
    return {"passes": passes, "first_step_s": first_step, "pass_s": sum(pass_seconds)}


def measure(repeats: int) -> list[dict]:
    """``repeats`` on/off pairs, each run in a fresh process with an empty Inductor cache."""
    runs = []
    for index in range(repeats):
        order = (True, False) if index % 2 == 0 else (False, True)
        for passes in order:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                argv = [sys.executable, __file__, "--one", "on" if passes else "off"]
                output = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(output.strip().splitlines()[-1]))
            print(runs[-1], flush=True)
    return runs


def table(runs: list[dict]) -> str:
    """Medians of each setting and the on/off ratio, as a markdown table."""
    on = [run for run in runs if run["passes"]]
    off = [run for run in runs if not run["passes"]]
    median_on = statistics.median(run["first_step_s"] for run in on)
    median_off = statistics.median(run["first_step_s"] for run in off)
    pass_share = statistics.median(run["pass_s"] / run["first_step_s"] for run in on)
    all_off = ", ".join(f"{run['first_step_s']:.1f}" for run in off)
    all_on = ", ".join(f"{run['first_step_s']:.1f}" for run in on)
    return "\n".join([
        "| passes | runs | cold first step, median s | all runs s | time inside OverlapPasses, median s |",
        "| --- | --- | --- | --- | --- |",
        f"| off | {len(off)} | {median_off:.1f} | {all_off} | - |",
        f"| on (auto, reorder) | {len(on)} | {median_on:.1f} | {all_on} | "
        f"{statistics.median(r['pass_s'] for r in on):.2f} |",
        "",
        f"on / off: {median_on / median_off:.3f} (cold compile {100 * (median_on / median_off - 1):+.1f}%); "
        f"the passes themselves take {100 * pass_share:.1f}% of a cold first step.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="on/off pairs")
    parser.add_argument("--out", default=None, help="also write the table here")
    parser.add_argument("--one", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one == "on")))
        os._exit(0)  # skip gloo/fake-group static destructors, as simplefsdp train does
    text = table(measure(args.repeats))
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
