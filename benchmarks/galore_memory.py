"""Optimizer state bytes per rank, AdamW against GaLoreAdamW (projector replicated in fp32 or bf16, and sharded), for
a reference model at any world size, and the bytes of a refresh (no training).

    python benchmarks/galore_memory.py --model llama3-8b --world-size 8 --rank 1024

Built on the meta device; counts rank 0's share (the largest: shards round up). AdamW: two fp32 moments of each
parameter's rows. GaLoreAdamW (``simplefsdp.optim.galore.is_projected`` decides which weights): two fp32 moments of
rows x rank and the n x rank projector (fp32, or bf16 with ``projector_dtype``), whole or its rows' share; one fp32
step counter per parameter for both. A refresh all-gathers each projected weight's fp32 gradient once: each rank
receives (W - 1) / W of it. A sharded projector is all-gathered (fp32) at every step, beside the step's own traffic:
each parameter gathered in the forward and again in the backward (bf16, reshard after forward) and its gradient
reduce-scattered (fp32).
"""

from __future__ import annotations

import argparse

import torch

from simplefsdp.models.llama import build_model, get_config
from simplefsdp.optim.galore import is_projected


def state_bytes(model: torch.nn.Module, world: int, rank: int, shard_projector: bool | None,
                projector_bytes: int = 4) -> tuple[int, int, int]:
    """(optimizer state bytes on rank 0, bytes each rank receives in a refresh, bytes each rank receives per step for
    the projectors); ``shard_projector=None``: AdamW; ``projector_bytes``: of a projector element."""
    state = refresh = per_step = 0
    for parameter in model.parameters():
        rows, shape = -(-parameter.shape[0] // world), tuple(parameter.shape)
        if shard_projector is not None and is_projected(shape, world, rank, shard_projector, projector_bytes / 4):
            projector_rows = -(-shape[1] // world) if shard_projector else shape[1]
            state += 4 * (2 * rows * rank + 1) + projector_bytes * projector_rows * rank
            refresh += 4 * parameter.numel() * (world - 1) // world
            per_step += projector_bytes * shape[1] * rank * (world - 1) // world if shard_projector else 0
        else:
            state += 4 * (2 * rows * parameter[0].numel() + 1)
    return state, refresh, per_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=None, help="GaLore's rank (the model's dim / 4)")
    args = parser.parse_args()
    rank, world = args.rank or get_config(args.model).dim // 4, args.world_size
    with torch.device("meta"):
        model = build_model(args.model)
    adamw, _, _ = state_bytes(model, world, rank, None)
    step = (2 + 2 + 4) * sum(p.numel() for p in model.parameters()) * (world - 1) // world
    print(f"{args.model}, {world} ranks, GaLore rank {rank}: optimizer state bytes per rank, AdamW "
          f"{adamw / 2**20:,.1f} MiB; a step's collectives receive {step / 2**20:,.1f} MiB per rank")
    for name, shard_projector, projector_bytes in (("replicated", False, 4), ("replicated bf16", False, 2),
                                                   ("sharded", True, 4)):
        galore, refresh, per_step = state_bytes(model, world, rank, shard_projector, projector_bytes)
        print(f"  GaLoreAdamW, projector {name}: {galore / 2**20:,.1f} MiB ({galore / adamw:.2f}x AdamW); a refresh "
              f"receives {refresh / 2**20:,.1f} MiB per rank; every step {per_step / 2**20:,.1f} MiB more "
              f"({per_step / max(step, 1):.1%} of the step's)")


if __name__ == "__main__":
    main()
