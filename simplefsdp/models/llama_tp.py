"""The Megatron tensor-parallel plan of the reference Llama, for torch's ``parallelize_module``.

Column-parallel ``wq``, ``wk``, ``wv``, ``w1``, ``w3`` (a rank computes ``n_heads / tp`` query heads,
``n_kv_heads / tp`` key/value heads and ``1 / tp`` of the SwiGLU width), row-parallel ``wo``, ``w2`` (their partial
sums all-reduced over tp): two all-reduces per block in the forward, two in the backward. The embedding is
row-parallel over the vocabulary (an all-reduce of the looked-up rows) and the output layer column-parallel with its
logits all-gathered, so the loss sees full logits. Norms stay replicated (no sequence parallelism).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from simplefsdp.models.llama import Llama, LlamaConfig


def check_tensor_parallel(config: LlamaConfig, tp: int) -> None:
    """Raise ``ValueError`` unless ``config`` splits evenly over ``tp`` ranks (whole heads on every rank)."""
    if tp < 1:
        raise ValueError(f"the tensor-parallel degree must be at least 1, got {tp}")
    for field in ("n_heads", "n_kv_heads"):
        if getattr(config, field) % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks needs {field} ({getattr(config, field)}) divisible "
                             f"by {tp}, so each rank holds whole heads; pick a tp that divides it")
    if config.tie_embeddings:
        raise ValueError("tensor parallelism shards the embedding by rows and the output layer by columns, which a "
                         "tied weight cannot be; build the model with tie_embeddings=False")


def tensor_parallel_plan(config: LlamaConfig) -> dict[str, ParallelStyle]:
    """Module FQN → parallel style, for ``parallelize_module`` (the module docstring's plan)."""
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    for layer in range(config.n_layers):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{layer}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{layer}.{name}"] = RowwiseParallel()
    return plan


def parallelize_llama(model: Llama, tp_mesh: DeviceMesh) -> Llama:
    """Apply ``tensor_parallel_plan`` to ``model`` over ``tp_mesh`` (1-D), in place, after ``check_tensor_parallel``."""
    check_tensor_parallel(model.config, tp_mesh.size())
    return parallelize_module(model, tp_mesh, tensor_parallel_plan(model.config))
