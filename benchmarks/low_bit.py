"""Bytes on the wire per step, predicted step time and exposed communication, with and without low-bit communication.

    python benchmarks/low_bit.py [--world-sizes 64 512] [--hardware h100-100g] > benchmarks/low_bit_llama3-8b.md

Traces llama3-8b (bf16 gathers, fp32 reductions) with ``simplefsdp.inspect`` on a fake process group; wire bytes per
rank as ``summary.json`` counts them (``ir.cost_model.wire_bytes``).
"""

from __future__ import annotations

import argparse

import torch

import simplefsdp
from simplefsdp.ir.cost_model import wire_bytes
from simplefsdp.models.llama import build_model

RUNS = {"full precision": None, "int8 gather, int8 reduce": simplefsdp.Quantize("int8", "int8"),
        "int8 gather, int4 reduce": simplefsdp.Quantize("int8", "int4")}


def step_wire_bytes(stage) -> float:
    return sum(wire_bytes(node.collective) for schedule in stage.schedules for node in schedule.collectives())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--hardware", default="h100-100g")
    args = parser.parse_args()
    with torch.device("meta"):
        model = build_model("llama3-8b")
    tokens = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    mp_policy = simplefsdp.MixedPrecision(torch.bfloat16, torch.float32)
    print(f"llama3-8b, 1x8192 tokens per rank, bf16 params, fp32 reduce, hardware {args.hardware}, reordered stage\n")
    print("| world | run | wire GiB/rank/step | × full | collectives | step s | exposed comm s |")
    print("|---|---|---|---|---|---|---|")
    for world in args.world_sizes:
        full = None
        for name, quantize in RUNS.items():
            stage = simplefsdp.inspect(model, (tokens,), world_size=world, hardware=args.hardware, mp_policy=mp_policy,
                                       quantize=quantize).stages[-1]
            wire = step_wire_bytes(stage)
            full = full or wire
            collectives = sum(len(schedule.collectives()) for schedule in stage.schedules)
            print(f"| {world} | {name} | {wire / 2**30:.2f} | {wire / full:.3f} | {collectives} | "
                  f"{stage.prediction.step_time:.3f} | {stage.prediction.exposed_communication:.3f} |", flush=True)


if __name__ == "__main__":
    main()
