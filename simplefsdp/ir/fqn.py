"""Owning-module names (FQNs) from the ``nn_module_stack`` that Dynamo records on each FX node."""

from __future__ import annotations

import re

from torch import fx

# A leading root such as L['self'], L["fn"] or a bare self / fn.
_ROOT = re.compile(r"""^(?:L|G)\[(['"])[^'"]*\1\]|^(?:self|fn)(?=\.|$)""")
# Container access written as ._modules['x'], ['x'], [0] or getattr(..., 'x').
_SUBSCRIPT = re.compile(r"""(?:\._modules)?\[(['"]?)([^'"\]]+)\1\]""")
# __self__: the module of a bound forward that a partial wraps (L['forward'].__self__.norm: inspect's loss);
# __dict__ and _modules: a submodule read through the instance dict (peft's LoRA wrapper: __dict__['_modules']).
_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "__self__", "__dict__", "_modules")
# A module's own bound forward: a partial of it (activation checkpointing), or the instance attribute compile_sharded
# sets (``module.forward = module.forward``: L['module'].forward.__self__.lm_head).
_BOUND_FORWARD = re.compile(r"\.forward(?:\.args\.0)?\.__self__(?=\.|$)")


def parse_module_path(path: str) -> str:
    """Turn a Dynamo or export module path into a plain FQN: ``L['fn'].layers.0.attn`` → ``layers.0.attn``; wrapper
    names such as ``_orig_mod`` are dropped, the root alone gives ``""``."""
    rest = _ROOT.sub("", path.strip())
    rest = _BOUND_FORWARD.sub("", _SUBSCRIPT.sub(lambda match: "." + match.group(2), rest))
    return ".".join(part for part in rest.split(".") if part and part not in _WRAPPERS)


def node_fqn(node: fx.Node) -> str:
    """The FQN of the innermost module that produced ``node``, or ``""`` for top-level code."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")  # backward nodes: the forward's
    if not stack:
        return ""
    path, _module_type = list(stack.values())[-1]
    return parse_module_path(path)
