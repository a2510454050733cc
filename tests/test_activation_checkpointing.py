"""Per-block activation checkpointing composes with sharding, and with compile_blocks_once, and leaves the losses
unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_on_ranks
from torch import nn
from scenarios import FORWARD_BACKWARD_BOUND, SGD_LR
from test_block_regions import _compiles_blocks_once

from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import apply_activation_checkpointing, compile_sharded
from simplefsdp.ir.capture import capture_graphs
from simplefsdp.models.llama import build_model
from simplefsdp.runtime.fake_world import fake_world
from simplefsdp.runtime.replicate_compute import ReplicateComputation
from simplefsdp.runtime.sharding import shard_parameters


def _losses(mode, compile_options):
    torch.manual_seed(0)
    model = build_model("debug")
    apply_activation_checkpointing(model.layers, mode)
    compile_sharded(model, **compile_options)
    if compile_options.get("backend") == "inductor":  # by default each block's compute is compiled once
        assert _compiles_blocks_once(model) is compile_options.get("compile_blocks_once", True), compile_options
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)  # linear in the gradients: see scenarios.py
    losses = []
    for step in range(3):
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(2 * step + dist.get_rank()))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _all_modes():
    """Eager without checkpointing is the reference: aot_eager graphs compute bitwise like eager."""
    return {
        "none": _losses("none", {"compile": False}),
        "full-eager": _losses("full", {"compile": False}),
        # Compiled graphs; codegen is not what is tested.
        "full": _losses("full", {"backend": "aot_eager"}),
        "selective": _losses("selective", {"backend": "aot_eager"}),
        # checkpointed inside each block's region
        "full-blocks-once": _losses("full", {"backend": "aot_eager", "compile_blocks_once": True}),
        "selective-blocks-once": _losses("selective", {"backend": "aot_eager", "compile_blocks_once": True}),
        # Inductor with the default bucketing and reordering passes (and, by default, each block's compute compiled
        # once, checkpointed inside its region): rounding may differ from eager.
        "full-inductor-passes": _losses("full", {"backend": "inductor", "buckets": "auto", "reorder": True}),
        "selective-inductor-passes": _losses("selective", {"backend": "inductor", "buckets": "auto", "reorder": True}),
        "selective-inductor-passes-whole-graph": _losses(
            "selective", {"backend": "inductor", "buckets": "auto", "reorder": True, "compile_blocks_once": False}),
    }


def test_checkpointing_leaves_losses_unchanged():
    for losses in run_on_ranks(2, _all_modes):
        for mode in ("full-eager", "full", "selective", "full-blocks-once", "selective-blocks-once"):
            assert losses[mode] == losses["none"], mode
        for mode in ("full-inductor-passes", "selective-inductor-passes", "selective-inductor-passes-whole-graph"):
            # Inductor reorders reductions: within fp32 rounding of the debug model's forward+backward
            assert losses[mode] == pytest.approx(losses["none"], rel=FORWARD_BACKWARD_BOUND, abs=0), mode
        # a region runs the whole graph's ops in the same order, and Inductor fuses within each block alike: bitwise
        assert losses["selective-inductor-passes"] == losses["selective-inductor-passes-whole-graph"]


class DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.relu(self.linear(x)))


def _dropout_outputs(mode: str, compile_blocks_once: bool) -> list[torch.Tensor]:
    """Output and gradients of 3 checkpointed dropout blocks, compiled with aot_eager, after seeding the same."""
    torch.manual_seed(0)
    model = nn.Sequential(*(DropoutBlock() for _ in range(3)))
    apply_activation_checkpointing(model, mode)
    compile_sharded(model, backend="aot_eager", compile_blocks_once=compile_blocks_once)
    torch.manual_seed(1)
    output = model(torch.randn(4, 8))
    output.sum().backward()
    return [output.detach()] + [param.grad.full_tensor() for param in model.parameters()]


def _hugging_face_outputs(checkpointing: dict | None, compile_blocks_once: bool) -> list[torch.Tensor]:
    """Loss and gradients of a 2-layer Hugging Face Llama, checkpointed by its own ``activation_checkpointing_enable``
    with ``checkpointing``'s arguments (None: not checkpointed), compiled with aot_eager."""
    from zoo import build

    model = build("llama", layers=2).train()
    config = model.config
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    compile_sharded(model, backend="aot_eager", compile_blocks_once=compile_blocks_once)
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = F.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return [loss.detach()] + [param.grad.full_tensor() for param in model.parameters()]


def _random_op_modes() -> dict[str, bool]:
    """For each checkpointing, whether output and gradients are bitwise those without it."""
    same = {}
    reference = _dropout_outputs("none", False)
    for mode in ("none", "selective", "full"):
        for once in (False, True):
            same[f"dropout-{mode}{'-blocks-once' * once}"] = all(map(torch.equal, _dropout_outputs(mode, once),
                                                                     reference))
    reference = _hugging_face_outputs(None, False)
    for reentrant in (False, True):
        for once in (False, True):
            outputs = _hugging_face_outputs({"use_reentrant": reentrant}, once)
            same[f"hugging-face-reentrant-{reentrant}{'-blocks-once' * once}"] = all(map(torch.equal, outputs,
                                                                                         reference))
    return same


def test_checkpointed_random_ops_are_saved_not_recomputed():
    """Both policies save what dropout and attention drew (torch 2.13's AOTAutograd failed on recomputing them beside
    DTensors), and so do Hugging Face layers checkpointed by ``activation_checkpointing_enable``, which failed the same
    way: aot_eager draws the same numbers in the same order whether a block is checkpointed, or compiled once, or
    neither, so output and gradients are bitwise those without checkpointing."""
    for modes in run_on_ranks(2, _random_op_modes):
        assert all(modes.values()), modes


def _batch_norm_outputs(mode: str, compile_blocks_once: bool) -> list[torch.Tensor]:
    """Output, gradients and buffers of a 2-block ResNet (``zoo.ResNet``) after 2 forward and backward calls,
    checkpointed with ``mode``, compiled with aot_eager."""
    from zoo import ResNet

    torch.manual_seed(0)
    model = ResNet(layers=2)
    apply_activation_checkpointing(model.layers, mode)
    compile_sharded(model, backend="aot_eager", compile_blocks_once=compile_blocks_once)
    for step in range(2):
        output = model(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2 * step + dist.get_rank())))
        output.sum().backward()
    return [output.detach(), *(param.grad.full_tensor() for param in model.parameters()), *model.buffers()]


def _batch_norm_modes() -> dict[str, bool]:
    """For each checkpointing, in regions and not, whether output, gradients and buffers are bitwise those without."""
    reference = _batch_norm_outputs("none", False)
    return {f"{mode}{'-blocks-once' * once}": all(map(torch.equal, _batch_norm_outputs(mode, once), reference))
            for mode in ("none", "full") for once in (False, True)}


def test_checkpointed_batch_norms_update_their_running_statistics_once_a_call():
    """A checkpointed block recomputes its forward in the backward; its batch norms' running statistics (updated in
    regions from copies the region returns) and ``num_batches_tracked`` still change once per call: aot_eager runs
    eager's kernels in eager's order, so all is bitwise the blocks' without checkpointing or regions."""
    for modes in run_on_ranks(2, _batch_norm_modes):
        assert all(modes.values()), modes


def _saved_activation_bytes(mode: str) -> int:
    """Bytes the compiled forward of the debug model (8 fake ranks) saves for backward, graph inputs excluded."""
    torch.manual_seed(0)
    model = build_model("debug")
    apply_activation_checkpointing(model.layers, mode)
    with fake_world(8):
        shard_parameters(model, init_device_mesh("cpu", (8,)), "fully_shard", ReplicateComputation(None, None, True))
        forward = capture_graphs(model, (torch.randint(0, 256, (2, 64)),), fused_attention=False).forward
    output = next(iter(forward.graph.find_nodes(op="output")))
    saved = [node for node in output.args[0][1:] if isinstance(node, torch.fx.Node) and node.op != "placeholder"]
    return sum(node.meta["val"].numel() * node.meta["val"].element_size() for node in saved
               if isinstance(node.meta.get("val"), torch.Tensor))


def test_checkpointing_saves_fewer_activations_under_compile():
    """Full keeps each block's input and its attention output (the one op that draws random numbers),
    selective also keeps matmul outputs; both save less than no checkpointing."""
    saved = {mode: _saved_activation_bytes(mode) for mode in ("none", "selective", "full")}
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown activation checkpointing mode 'some'"):
        apply_activation_checkpointing([], "some")


def test_selective_saves_every_fused_attention_kernel_sdpa_dispatches_to():
    """An H100 dispatches to cuDNN attention (seen by inspect --device cuda); it is saved like flash, not recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    from simplefsdp.runtime.activation_checkpoint import _save_matmuls

    aten = torch.ops.aten
    for kernel in (aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
                   aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu):
        assert _save_matmuls(None, kernel.default) == CheckpointPolicy.MUST_SAVE
