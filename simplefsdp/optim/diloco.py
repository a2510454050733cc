"""``DiLoCo``: inner AdamW steps, and every ``sync_every`` steps an outer Nesterov step on the pseudo-gradient averaged
over replica groups (Douillard et al.).

Every parameter keeps an anchor (its value at the last outer step) and an outer momentum in the optimizer's state
(why there: ``ARCHITECTURE.md``, "Fault-tolerant replica groups"). The pseudo-gradient ``anchor - parameter`` of every
local shard goes in one flat all-reduce (with ``outer_quantize``, an all-gather in ``Quantize``'s wire format, no error
feedback, as Streaming DiLoCo); the outer step is ``m = mu * m + g; anchor -= outer_lr * (g + mu * m)`` (torch's
Nesterov SGD), and the parameters become the anchor, bitwise equal in every group.
"""

from __future__ import annotations

import torch

from simplefsdp.optim.exchange import ONE_GROUP, Collectives
from simplefsdp.optim.galore import local
from simplefsdp.runtime.quantize import QMAX, Quantize, packed_block_bytes, quantize_pack, unpack_dequantize

BLOCK_SIZE = Quantize.block_size  # values per fp32 scale of a quantized pseudo-gradient: Quantize's default


class DiLoCo(torch.optim.AdamW):
    """AdamW inside a replica group; every ``sync_every`` steps, Nesterov SGD (``outer_lr``, ``outer_momentum``:
    DiLoCo's 0.7 and 0.9) on the pseudo-gradient averaged across groups, sent in fp32 or, with ``outer_quantize``
    (``"int8"`` or ``"int4"``), as low-bit blocks. Other keywords go to ``AdamW``."""

    def __init__(self, params, lr: float = 1e-3, sync_every: int = 32, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_quantize: str | None = None, **adamw) -> None:
        if sync_every < 1 or outer_lr <= 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"DiLoCo needs sync_every >= 1, outer_lr > 0 and 0 <= outer_momentum < 1; got "
                             f"{sync_every}, {outer_lr}, {outer_momentum}")
        if outer_quantize not in (None, *QMAX):
            raise ValueError(f"DiLoCo(outer_quantize={outer_quantize!r}): choose 'int8', 'int4' or None (fp32)")
        super().__init__(params, lr=lr, **adamw)
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, outer_lr, outer_momentum
        self.outer_quantize, self.averaged, self.exchanged = outer_quantize, None, False

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def exchange(self, collectives: Collectives = ONE_GROUP, step: int | None = None) -> None:
        """Take the inner AdamW step; on a sync step (``step``, the training step, a multiple of ``sync_every``; by
        default the inner step count) all-reduce the pseudo-gradient for ``step`` to apply."""
        fresh = [p for p in self._params() if "outer_anchor" not in self.state[p]]
        anchors = [p.detach().clone() for p in fresh]
        super().step()
        for p, anchor in zip(fresh, anchors):
            self.state[p].update(outer_anchor=anchor, outer_momentum=torch.zeros_like(p))
        step = int(self.state[self._params()[0]]["step"]) if step is None else step
        self.averaged, self.exchanged = None, True
        if step % self.sync_every == 0:
            pseudo_gradient = torch.cat(
                [(local(self.state[p]["outer_anchor"]) - local(p)).reshape(-1) for p in self._params()])
            self.averaged = collectives.all_reduce_mean(pseudo_gradient) if self.outer_quantize is None else \
                quantized_mean(pseudo_gradient, collectives, self.outer_quantize)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """The outer step, if ``exchange`` synchronized this step (calling ``exchange`` first if it was not called)."""
        if not self.exchanged:
            self.exchange()
        if self.averaged is not None:
            offset = 0
            for p in self._params():
                state, shard = self.state[p], local(p)
                pseudo_gradient = self.averaged[offset:offset + shard.numel()].view_as(shard)
                offset += shard.numel()
                momentum = local(state["outer_momentum"]).mul_(self.outer_momentum).add_(pseudo_gradient)
                anchor = local(state["outer_anchor"])
                anchor.sub_(pseudo_gradient.add(momentum, alpha=self.outer_momentum), alpha=self.outer_lr)
                shard.copy_(anchor)
        self.averaged, self.exchanged = None, False

    @torch.no_grad()
    def discard(self) -> None:
        """A step that did not commit: after a sync, the parameters go back to the anchor (the inner steps since the
        last outer step are lost, as torchft's DiLoCo does)."""
        if self.averaged is not None:
            for p in self._params():
                local(p).copy_(local(self.state[p]["outer_anchor"]))
        self.averaged, self.exchanged = None, False


def packed_bytes(numel: int, fmt: str) -> int:
    """The bytes ``quantized_mean`` sends for ``numel`` values: an fp32 scale and the codes of each block."""
    return -(-numel // BLOCK_SIZE) * packed_block_bytes(fmt, BLOCK_SIZE)


def quantized_mean(flat: torch.Tensor, collectives: Collectives, fmt: str) -> torch.Tensor:
    """The mean over groups of ``flat`` (1-D fp32) as each group's packed ``fmt`` blocks decode: every group decodes
    the same bytes in the same order, so every group gets the same bits."""
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK_SIZE)).reshape(1, -1)
    rows = collectives.all_gather(quantize_pack(padded, fmt, BLOCK_SIZE))
    return unpack_dequantize(torch.cat(rows), fmt, BLOCK_SIZE).mean(0)[:flat.numel()]
