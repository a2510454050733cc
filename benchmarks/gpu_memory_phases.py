"""Where one training step's GPU memory goes: bytes allocated before and after each phase, and the peak inside it.

One rank on one GPU, the model built and compiled as `bench`'s `simplefsdp` contender; three steps, so steps 2 and 3
show the steady state (AdamW's state exists). Takes `bench`'s workload options. Usage, on a machine with a GPU:
    python benchmarks/gpu_memory_phases.py --model llama3-8b --layers 2 --batch-size 1 --seq-len 8192 \
        --param-dtype bfloat16 --reduce-dtype float32
Recorded in benchmarks/gpu_h100.md.
"""

import os
import sys

import torch
import torch.distributed as dist

from simplefsdp.bench.contenders import CONTENDERS
from simplefsdp.bench.measure import build, step_batch
from simplefsdp.cli import build_parser
from simplefsdp.models.workload import load_workload, micro_batches

GiB = 2 ** 30


def phase(name: str, run):
    """``run()``, printing the bytes allocated before and after it and the peak while it ran."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = run()
    torch.cuda.synchronize()
    print(f"{name:10s} before {before / GiB:7.2f} GiB  peak {torch.cuda.max_memory_allocated() / GiB:7.2f} GiB  "
          f"after {torch.cuda.memory_allocated() / GiB:7.2f} GiB", flush=True)
    return result


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    args = build_parser().parse_args(["bench", *sys.argv[1:]])
    workload = load_workload(args.model, args.layers)
    model, optimizer = build(next(c for c in CONTENDERS if c.name == "simplefsdp"), args, workload)
    tokens = workload.tokens(model, None, args.seed)
    for step in (1, 2, 3):
        (inputs, target), = micro_batches(step_batch(args, workload, tokens, step), 1, "cuda")
        print(f"step {step}")
        loss = phase("forward", lambda: model(*inputs, target))  # bench's module: the loss is in the forward
        phase("backward", loss.backward)
        phase("optimizer", optimizer.step)
        phase("zero_grad", optimizer.zero_grad)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
