"""Owning-module names parsed from Dynamo's ``nn_module_stack`` paths."""

import pytest
import torch
from torch import fx

from simplefsdp.ir.fqn import node_fqn, parse_module_path


@pytest.mark.parametrize(
    "path, fqn",
    [
        ("L['fn'].layers.0.attn", "layers.0.attn"),
        ("L['self'].layers.0.attention.wq", "layers.0.attention.wq"),
        ('L["self"].layers.3', "layers.3"),
        ("L['self']._modules['layers']._modules['0'].wq", "layers.0.wq"),
        ("L['self'].layers[2].feed_forward", "layers.2.feed_forward"),
        ("L['fn']._orig_mod.layers.1", "layers.1"),
        ("L['self'].layers.0._checkpoint_wrapped_module.mlp", "layers.0.mlp"),
        ("L['self'].layers[0].forward.args[0].__self__.attention.wq", "layers.0.attention.wq"),  # checkpointed block
        ("L['forward'].__self__.layers[0].forward.args[0].__self__.wq", "layers.0.wq"),  # and inspect's loss
        ("L['module'].forward.__self__.model.embed_tokens", "model.embed_tokens"),  # compile_sharded's own forward
        ("L['module'].__dict__['_modules']['base_model'].model.lm_head", "base_model.model.lm_head"),  # peft
        ("self.layers.1.ffn", "layers.1.ffn"),
        ("fn.norm", "norm"),
        ("L['self']", ""),
        ("output", "output"),
    ],
)
def test_parse_module_path(path, fqn):
    assert parse_module_path(path) == fqn


def test_node_fqn_takes_innermost_module_and_falls_back_to_backward_stack():
    graph = fx.Graph()
    forward_node = graph.call_function(torch.relu, ())
    forward_node.meta["nn_module_stack"] = {
        "a": ("L['self'].layers.0", object), "b": ("L['self'].layers.0.attention", object),
    }
    backward_node = graph.call_function(torch.relu, ())
    backward_node.meta["fwd_nn_module_stack"] = {"a": ("L['fn'].norm", object)}
    top_level = graph.call_function(torch.relu, ())
    assert node_fqn(forward_node) == "layers.0.attention"
    assert node_fqn(backward_node) == "norm"
    assert node_fqn(top_level) == ""
