"""The zoo's families at the depths of the models users train, beyond what the suite can afford: each trained with
``compile_sharded``'s defaults on 2 gloo ranks and checked as ``tests/test_zoo.py`` checks it (3 SGD steps against one
process, or DDP for batch norm; the bounds of ``tests/zoo.py``, derived from each model's chain of blocks).

    python benchmarks/zoo_depth.py gpt2=48 bert=24 t5=24 --out benchmarks/zoo_depth.md

Every model runs in fresh ranks of its own, one after the other. Needs the ``test`` extra (``transformers``, ``peft``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import test_zoo  # noqa: E402
from ranks import run_on_ranks  # noqa: E402
from simplefsdp import compile_sharded  # noqa: E402
from simplefsdp.runtime.block_regions import _run_block  # noqa: E402
from zoo import ZOO, build, zoo_bound  # noqa: E402


def _train_on_rank(name: str, layers: int) -> dict:
    """This rank's losses and final parameters under the defaults (and DDP's, for a batch-norm model)."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    model = compile_sharded(build(name, layers))
    losses, params = test_zoo._train(name, model, rank, ranks)
    result = {"losses": losses, "params": params, "seconds": time.perf_counter() - start,
              "in_regions": any(getattr(vars(module).get("forward"), "func", None) is _run_block
                                for module in model.modules())}
    if ZOO[name].reference == "ddp":
        ddp_losses, ddp_params = test_zoo._train(name, DistributedDataParallel(build(name, layers)), rank, ranks)
        result["reference"] = ddp_losses, {key.removeprefix("module."): p for key, p in ddp_params.items()}
    return result


def check(name: str, layers: int) -> str:
    """One row of the table: ``name`` at ``layers`` blocks, checked with ``test_zoo``'s assertions."""
    ZOO[name] = dataclasses.replace(ZOO[name], depth=layers)  # the bounds read the chain at this depth
    per_rank = run_on_ranks(2, _train_on_rank, name, layers)
    initial = dict(build(name, layers).named_parameters())
    if ZOO[name].reference == "process":
        reference = test_zoo._train(name, build(name, layers))
        losses = [sum(values) / 2 for values in zip(*(result["losses"] for result in per_rank))]
        params = [result["params"] for result in per_rank]
    else:
        reference, losses, params = per_rank[0]["reference"], per_rank[0]["losses"], [per_rank[0]["params"]]
    try:
        test_zoo._assert_close(name, losses, reference[0], initial, reference[1], params)
        verdict = "within bounds"
    except AssertionError as error:
        verdict = f"**failed**: {str(error).splitlines()[0]}"
    gap = max(abs(loss - ref) / abs(ref) for loss, ref in zip(losses, reference[0]))
    return (f"| {name} | {layers} | {ZOO[name].chain} | {gap:.1e} | {zoo_bound(ZOO[name].chain):.1e} | "
            f"{per_rank[0]['in_regions']} | {max(result['seconds'] for result in per_rank):.0f} | {verdict} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", metavar="NAME=LAYERS", help=f"of: {', '.join(ZOO)}")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    lines = ["| model | layers | chain | loss gap (relative, largest of 3 steps) | its bound | in regions | "
             "s to compile and train (2 ranks) | losses and update (`test_zoo`'s checks) |",
             "|---|---|---|---|---|---|---|---|"]
    for model in args.models:
        name, _, layers = model.partition("=")
        lines.append(check(name, int(layers)))
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
