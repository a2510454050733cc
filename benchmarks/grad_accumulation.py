"""Gradient accumulation in bf16 compute with fp32 reduction: how far each way's accumulated gradient is from fp32.

    .venv/bin/python benchmarks/grad_accumulation.py [--micro-batches 8] [--backend inductor]

On 2 gloo ranks, the debug Llama accumulates ``--micro-batches`` micro-batches with ``param_dtype=bfloat16,
reduce_dtype=float32`` under FSDP2 (``set_requires_gradient_sync(False)`` but for the last) and under simplefsdp
reducing after the last micro-batch or after every one. Each gradient is compared with one fp32 process on the whole
batch (norm-wise relative error, the worst parameter and the median over parameters), in the same run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ranks import run_on_ranks  # noqa: E402  (the suite's launcher of local gloo ranks)

from simplefsdp import MixedPrecision, compile_sharded  # noqa: E402
from simplefsdp.models.llama import build_model  # noqa: E402


def _loss(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())


def _accumulate(model, micro_batches, reduce_every):
    for index, micro_batch in enumerate(micro_batches):
        model.set_requires_gradient_sync(reduce_every or index == len(micro_batches) - 1)
        (_loss(model, micro_batch) / len(micro_batches)).backward()
    return {name: param.grad.full_tensor() for name, param in model.named_parameters()}


def _errors(micro_batch_count: int, backend: str) -> dict[str, list[float]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    base = build_model("debug")
    world, rank = dist.get_world_size(), dist.get_rank()
    data = torch.randint(0, 256, (world * micro_batch_count * 2, 33), generator=torch.Generator().manual_seed(1))
    micro_batches = data.chunk(world)[rank].chunk(micro_batch_count)
    reference = copy.deepcopy(base)
    _loss(reference, data).backward()
    expected = {name: param.grad for name, param in reference.named_parameters()}

    fsdp2 = copy.deepcopy(base)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in fsdp2.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(fsdp2, mp_policy=policy)
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    grads = {"FSDP2 eager, reduce after the last": _accumulate(fsdp2, micro_batches, False)}
    for reduce_every, label in ((False, "the last"), (True, "every micro-batch")):
        model = compile_sharded(copy.deepcopy(base), mp_policy=mixed, backend=backend)
        grads[f"simplefsdp ({backend}), reduce after {label}"] = _accumulate(model, micro_batches, reduce_every)
    return {way: [((grad[name] - want).norm() / want.norm()).item() for name, want in expected.items()]
            for way, grad in grads.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    errors = run_on_ranks(2, _errors, args.micro_batches, args.backend)[0]
    print(f"| debug Llama, 2 gloo ranks, {args.micro_batches} micro-batches, bf16 compute, fp32 reduce "
          "| worst relative error | median |\n|---|---|---|")
    for way, values in errors.items():
        print(f"| {way} | {max(values):.3e} | {statistics.median(values):.3e} |")


if __name__ == "__main__":
    main()
