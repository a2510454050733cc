"""PyTorch's object collectives without NumPy.

``all_gather_object``, ``gather_object``, ``broadcast_object_list`` and
``scatter_object_list`` (used by our cross-rank model check and by
``torch.distributed.checkpoint``) decode received bytes with ``tensor.numpy()``,
which fails when NumPy is not installed. This swaps in a decoder that does not
need it; nothing changes when NumPy is present.
"""

from __future__ import annotations

import importlib.util
import io

import torch
import torch.distributed.distributed_c10d as c10d


def _tensor_to_object(tensor: torch.Tensor, tensor_size: int, group=None):
    data = bytes(tensor.cpu()[: int(tensor_size)].tolist())
    return c10d._unpickler(io.BytesIO(data)).load()


def install_numpy_free_object_collectives() -> None:
    """Make the object collectives work without NumPy (idempotent; a no-op when NumPy is importable)."""
    if importlib.util.find_spec("numpy") is None:
        c10d._tensor_to_object = _tensor_to_object
