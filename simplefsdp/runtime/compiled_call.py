"""A model's call replaced by its compiled graphs, so ``model(...)`` runs them even under an outer
``torch.compile``."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
from torch import nn


def set_compiled_call(module: nn.Module, call: Callable) -> None:
    """Make ``module(...)`` run ``call``, also inside an outer ``torch.compile`` (of the model, as FSDP2 users write
    after ``fully_shard``, or of a function calling it): Dynamo breaks its graph there and runs ``call``, our compiled
    graphs, instead of tracing the sharded model again without our passes and rank guard; ``module.compile()`` keeps
    ``call`` too."""
    module._compiled_call_impl = torch.compiler.disable(
        call, reason="compile_sharded compiled this model already; an outer torch.compile runs its graphs as they are, "
        "which fullgraph=True forbids: drop fullgraph=True there, or the outer torch.compile")
    # Dynamo inlines a module's forward, skipping _compiled_call_impl, unless the module holds a forward of its own
    module.forward = module.forward
    module.compile = functools.partial(_compiled_already, type(module).__name__)


def _compiled_already(name: str, *args: Any, **kwargs: Any) -> None:
    """``model.compile(...)`` (``nn.Module.compile``) of a model ``compile_sharded`` compiled: its graphs stay."""
    if args or kwargs:
        warnings.warn(f"{name}.compile(...) keeps the graphs compile_sharded compiled, so its arguments apply to "
                      "nothing: pass backend, mode, options, fullgraph or dynamic to compile_sharded", stacklevel=2)
