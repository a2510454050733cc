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

import test_zoo  # noqa: E402
from ranks import run_on_ranks  # noqa: E402
from zoo import ZOO, zoo_bound  # noqa: E402


def _train_on_rank(name: str, layers: int) -> dict:
    """This rank's results of ``test_zoo.train_with_defaults``, and the seconds they took."""
    start = time.perf_counter()
    result = test_zoo.train_with_defaults(name, layers)[0]
    return result | {"seconds": time.perf_counter() - start}


def check(name: str, layers: int) -> str:
    """One row of the table: ``name`` at ``layers`` blocks, checked with ``test_zoo``'s assertions."""
    ZOO[name] = dataclasses.replace(ZOO[name], depth=layers)  # the bounds read the chain at this depth
    per_rank = run_on_ranks(2, _train_on_rank, name, layers)
    try:
        gap, verdict = f"{test_zoo.check_against_reference(name, per_rank, layers):.1e}", "within bounds"
    except AssertionError as error:
        gap, verdict = "-", f"**failed**: {str(error).splitlines()[0]}"
    return (f"| {name} | {layers} | {ZOO[name].chain} | {gap} | {zoo_bound(ZOO[name].chain):.1e} | "
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
