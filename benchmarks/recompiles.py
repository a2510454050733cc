"""Recompilations when the last batch of an epoch is smaller: 20 steps of ``compile_sharded(build_model("debug"))``
with the default options in a 1-rank world, two epochs of 38 sequences in batches of 4 (the last batch holds 2).

    python benchmarks/recompiles.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from simplefsdp import compile_sharded
from simplefsdp.models.llama import build_model

EPOCHS, SEQUENCES, BATCH, SEQ_LEN = 2, 38, 4, 32


def main() -> None:
    torch.manual_seed(0)
    model = compile_sharded(build_model("debug"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = torch.randint(0, 256, (SEQUENCES, SEQ_LEN + 1))
    step = 0
    for _ in range(EPOCHS):
        for batch in data.split(BATCH):
            step += 1
            graphs, begin = counters["stats"]["unique_graphs"], time.perf_counter()
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            note = "  recompiled" if step > 1 and counters["stats"]["unique_graphs"] > graphs else ""
            print(f"step {step:2d}  batch {len(batch)}  loss {loss.item():.4f}  {time.perf_counter() - begin:6.2f} s"
                  f"{note}", flush=True)
    graphs = counters["stats"]["unique_graphs"]
    print(f"{step} steps: {graphs} graph(s) compiled by Dynamo, {graphs - 1} recompile(s)")


if __name__ == "__main__":
    main()
