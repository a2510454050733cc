"""``find_blocks`` in containers of every kind and in stages of layers that differ, and the bucket each block found
gets (the fake process group, world size 8, one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from simplefsdp.passes.bucket_plan import find_blocks, plan_buckets
from scenarios import TwoLinears
from test_passes import kinds, traced


class BlockDict(nn.Module):
    """Repeated blocks in an ``nn.ModuleDict`` keyed by strings."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({name: TwoLinears() for name in ("first", "second", "third")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


class DecoderStyle(nn.Module):
    """Hugging Face's layout: ``model.decoder.layers.N``, then an output head outside the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.decoder = nn.Module()
        self.model.decoder.layers = nn.ModuleList(TwoLinears() for _ in range(3))
        self.lm_head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.decoder.layers:
            x = layer(x)
        return self.lm_head(x)


class ConvLayer(nn.Module):
    """A RegNet-style layer: a shortcut where it changes width, then its own sequence of which two are alike."""

    def __init__(self, width_in: int, width: int) -> None:
        super().__init__()
        self.shortcut = nn.Linear(width_in, width) if width_in != width else nn.Identity()
        self.layer = nn.Sequential(nn.Linear(width_in, width), nn.ReLU(), nn.Linear(width, width),
                                   nn.Linear(width, width))


class Stage(nn.Module):
    def __init__(self, width_in: int, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(ConvLayer(width_in, width), *(ConvLayer(width, width) for _ in range(depth - 1)))


def test_a_stage_of_layers_that_differ_holds_layers_not_blocks_of_their_insides():
    """A stage of two layers that differ (the first changes width) has no repeated layer; beside stages of more, its
    layers are layers too, and the two alike linear layers inside each are not blocks (a region's output the layer
    then updates in place, as RegNet's ``hidden_state += residual``, fails in torch 2.13). Alone, they still are."""
    model = nn.Module()
    model.stages = nn.ModuleList([Stage(4, 8, 2), Stage(8, 16, 3)])
    assert find_blocks(model) == ("stages.1.layers.1", "stages.1.layers.2")
    assert find_blocks(Stage(4, 8, 2)) == ("layers.0.layer.2", "layers.0.layer.3", "layers.1.layer.0",
                                           "layers.1.layer.2", "layers.1.layer.3")


@pytest.mark.parametrize("build, blocks, tail", [
    (lambda: nn.Sequential(TwoLinears(), TwoLinears(), TwoLinears()), ["0", "1", "2"], []),
    (BlockDict, ["blocks.first", "blocks.second", "blocks.third"], []),
    (DecoderStyle, [f"model.decoder.layers.{i}" for i in range(3)], ["tail"]),
])
def test_blocks_found_in_any_container_get_one_bucket_each(fake_world, build, blocks, tail):
    model = build()
    assert find_blocks(model) == tuple(blocks)
    _, forward, backward = traced(True, model, (torch.randn(2, 8),))
    assert kinds(plan_buckets(forward, "block", find_blocks(model))) == [("all_gather", b) for b in blocks + tail]
    backward_plan = plan_buckets(backward, "block", find_blocks(model))
    assert [n for k, n in kinds(backward_plan) if k == "reduce_scatter"] == tail + blocks[::-1]
    assert f"{len(blocks)} block(s) {blocks[0]} .. {blocks[-1]}" in str(backward_plan)
