"""Sharded checkpoints of model and optimizer with ``torch.distributed.checkpoint`` (DCP).

Each rank writes and reads only its own shards, and DCP reshards on load (save on N ranks, load on any number).
``<root>/step-<step>`` is written under a temporary name and renamed when complete, so a save killed halfway leaves
the previous checkpoint the latest complete one."""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from simplefsdp.runtime.quantize import error_feedback_state

_COMPLETE = re.compile(r"^step-(\d+)$")


def checkpoint_path(root: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return Path(root) / f"step-{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None if there is none."""
    root = Path(root)
    complete = [(int(match[1]), path) for path in (root.iterdir() if root.is_dir() else ())
                if (match := _COMPLETE.match(path.name)) and (path / ".metadata").is_file()]
    return max(complete)[1] if complete else None


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Save ``model``, ``optimizer`` (sharded) and error feedback buffers with ``step`` as ``<root>/step-<step>``;
    all ranks call it."""
    final = checkpoint_path(root, step)
    partial = final.with_name(f".{final.name}.partial")
    is_writer = dist.get_rank() == 0
    if is_writer:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": step, "errors": error_feedback_state(model)},
             checkpoint_id=partial)
    if is_writer:  # the complete checkpoint replaces one of the same step
        stale = final.with_name(f".{final.name}.stale")
        shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load the checkpoint at ``path`` into ``model`` (its error feedback too, and ``optimizer``) in place; return
    its step. Raises ``ValueError`` naming the first parameter whose shape differs, before any collective."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata file); pass a step-* directory")
    model_state = get_model_state_dict(model)
    check_compatible(path, model_state)
    state = {"model": model_state, "step": -1, "errors": loadable_errors(path, error_feedback_state(model))}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return state["step"]


def check_compatible(path: Path, model_state: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first model entry missing from, or shaped differently in, the checkpoint."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, tensor in model_state.items():
        entry = saved.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"checkpoint {path} has no parameter {name!r}: it was saved from a different model")
        if tuple(entry.size) != tuple(tensor.shape):
            raise ValueError(f"checkpoint {path} holds parameter {name!r} with shape {tuple(entry.size)}, but the "
                             f"model's is {tuple(tensor.shape)}: it was saved from a different model; build the same "
                             "model to resume")
    unexpected = sorted({key[len("model."):] for key in saved if key.startswith("model.")} - set(model_state))
    if unexpected:
        raise ValueError(f"checkpoint {path} has parameter {unexpected[0]!r} that the model lacks: different model")


def loadable_errors(path: Path, errors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``errors`` if the checkpoint holds error feedback buffers of the same shapes, else none, with one warning: a
    checkpoint of another world size (or without quantize) restarts error feedback from zero, which is sound."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, tensor in errors.items():
        entry = saved.get(f"errors.{name}")
        shape = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        if shape != tuple(tensor.shape):
            warnings.warn(f"checkpoint {path} holds error feedback buffers of another shape ({name}: {shape} there, "
                          f"{tuple(tensor.shape)} here: saved at another world size, or without quantize): error "
                          "feedback restarts from zero", stacklevel=3)
            return {}
    return errors
