"""What an optimizer that talks across replica groups needs from them, and the one-group stand-in."""

from __future__ import annotations

from typing import Protocol

import torch


class Collectives(Protocol):
    """Collectives across replica groups, over this rank's peers (the same rank of every group)."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every participating group's ``tensor`` (the same shape everywhere), in the groups' order."""

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over the participating groups (in place)."""


class OneGroup:
    """The collectives of a job with one replica group: nothing to exchange."""

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


ONE_GROUP = OneGroup()
