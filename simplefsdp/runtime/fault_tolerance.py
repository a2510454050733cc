"""Fault-tolerant replica groups on torchft (the ``ft`` extra): each group trains ``fully_shard`` in its own
``torchrun`` world, and what crosses groups is the ``sync`` mode's (``ARCHITECTURE.md``, "Fault-tolerant replica
groups"). The optimizer steps only when the step commits; a restarted group heals from a live one, then rejoins.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import zlib
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllgatherOptions
from torch.distributed.tensor import DTensor

from simplefsdp.names import SYNC_MODES
from simplefsdp.optim import DeMo, DiLoCo
from simplefsdp.optim.galore import local

INSTALL = "install it with: pip install 'simplefsdp[ft]' (torchft 0.2.0)"


def check_lighthouse(address: str, wait_seconds: float = 10.0) -> None:
    """Raise ``ConnectionError`` naming ``address`` unless the lighthouse accepts a connection within the wait."""
    url = urlparse(address if "://" in address else f"http://{address}")
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            socket.create_connection((url.hostname, url.port), timeout=wait_seconds).close()
            return
        except OSError as error:
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"cannot reach the torchft lighthouse at {address} ({error}); start one with "
                    f"`torchft_lighthouse --min_replicas 1 --bind {url.hostname}:{url.port}`, or pass the address "
                    "of the running one (--lighthouse or TORCHFT_LIGHTHOUSE)") from None
            time.sleep(0.2)


class ReplicaGroup:
    """This rank's view of the replica groups: the step's quorum, what crosses groups (``sync``, one of
    ``SYNC_MODES``; ``demo`` needs a ``DeMo`` optimizer, ``diloco`` a ``DiLoCo``), commit, healing; and the
    ``Collectives`` those optimizers exchange through, counting the bytes this rank sends."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: int, groups: int, lighthouse: str,
                 timeout: timedelta = timedelta(seconds=20), sync: str = "step") -> None:
        wanted = {"demo": DeMo, "diloco": DiLoCo}.get(sync)
        if sync not in SYNC_MODES or (not isinstance(optimizer, wanted) if wanted
                                      else isinstance(optimizer, (DeMo, DiLoCo))):
            raise ValueError(f"sync={sync!r} with {type(optimizer).__name__}: 'step' takes an optimizer that does not "
                             "exchange on its own, 'demo' simplefsdp.optim.DeMo, 'diloco' simplefsdp.optim.DiLoCo")
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager logs every quorum at info
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # the ft extra: checked before launch
        check_lighthouse(lighthouse)
        if not torch.cuda.is_available():  # its one warning on CPU is about NCCL's flight recorder
            logging.getLogger("torchft.manager").setLevel(logging.ERROR)
        self.model, self.optimizer, self.groups, self.sync = model, optimizer, groups, sync
        self.sent_bytes = 0  # by this rank across groups in the current step, as a ring algorithm sends them
        self.process_group = (ProcessGroupNCCL if torch.cuda.is_available() else ProcessGroupGloo)(timeout=timeout)
        # The Manager finds its group's rank 0 through a store: a new one per start, never a dead rank's address.
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # a 1-rank world of its own has none
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if dist.get_rank() == 0 else None
        port = [self.store.port if self.store else None]
        dist.broadcast_object_list(port, src=0)
        self.manager = Manager(
            pg=self.process_group, min_replica_size=1, load_state_dict=self.load_state_dict, state_dict=self.state_dict,
            replica_id=f"group{group}", lighthouse_addr=lighthouse, use_async_quorum=False, init_sync=False,
            timeout=timeout, quorum_timeout=timedelta(minutes=5), connect_timeout=timeout, store_addr=host,
            store_port=port[0], rank=dist.get_rank(), world_size=dist.get_world_size(),
        )

    def steps(self, start: int, last: int, join_seconds: float = 60.0) -> Iterator[int]:
        """The steps to train after ``start`` up to ``last``. Each joins its quorum first, healing this group if it is
        behind. A job's first start, new or resumed, waits up to ``join_seconds`` for every group, so it starts with
        all of them: a group that joined later would heal, taking another group's state for its own (its momentum
        under ``demo``, its inner AdamW under ``diloco``). A group restarted after a failure joins at once."""
        if start:
            self.manager.load_state_dict({"step": start, "batches_committed": 0})
        deadline = time.monotonic() + join_seconds
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        while True:
            self.manager.start_quorum()
            if first_start and self.manager.current_step() == start and self.participants < self.groups \
                    and time.monotonic() < deadline:
                self.manager.report_error(RuntimeError("waiting for every replica group to join the first step"))
                self.manager.should_commit()
                time.sleep(0.2)
                continue
            if self.manager.current_step() >= last:
                return
            self.sent_bytes = 0
            yield self.manager.current_step() + 1

    @property
    def participants(self) -> int:
        """How many replica groups take part in the current step."""
        return self.manager.num_participants()

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over the participating groups, in place; a failure makes the step uncommitted."""
        self.manager.allreduce(tensor).wait()
        self.sent_bytes += 2 * (self.participants - 1) * tensor.nbytes // self.participants
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every participating group's ``tensor``, in quorum order. A failure makes the step uncommitted and returns
        this group's ``tensor`` in every place (well-formed, so decoding it is safe; the step will not apply it)."""
        participants = self.participants
        self.sent_bytes += (participants - 1) * tensor.nbytes
        if participants == 1 or self.manager.errored():
            return [tensor] * participants
        outputs = [torch.empty_like(tensor) for _ in range(participants)]
        work = self.process_group.allgather([outputs], [tensor], AllgatherOptions())
        self.manager.wrap_future(work.get_future(), None).wait()
        return [tensor] * participants if self.manager.errored() else outputs

    def average_gradients(self) -> None:
        """With ``sync="step"``: average every gradient shard over the participating groups, in one flat all-reduce;
        the other modes exchange in the optimizer instead."""
        if self.sync != "step":
            return
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        flat = self.all_reduce_mean(torch.cat([grad.reshape(-1) for grad in grads]))
        for grad, averaged in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(averaged.view_as(grad))

    def step_optimizer(self, step: int) -> bool:
        """Step the optimizer if every participant finished training ``step`` (the optimizers of ``demo`` and
        ``diloco`` exchange first, and drop their exchange if not); returns whether the step committed."""
        if self.sync != "step":
            self.optimizer.exchange(self, step)
        committed = self.manager.should_commit()
        if committed:
            self.optimizer.step()
        elif self.sync != "step":
            self.optimizer.discard()
        return committed

    def state_dict(self) -> dict:
        """What a healing group copies: local parameter and buffer shards, optimizer state, RNG."""
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {index: {key: local(value) for key, value in state.items()}
                              for index, state in optimizer["state"].items()}
        return {"tensors": [local(t) for t in (*self.model.parameters(), *self.model.buffers())],
                "optimizer": optimizer, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        """Copy a live group's state (see ``state_dict``) into this group's model and optimizer."""
        with torch.no_grad():
            for tensor, saved in zip((*self.model.parameters(), *self.model.buffers()), state["tensors"]):
                local(tensor).copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        for param, param_state in self.optimizer.state.items():  # moments are DTensors like their parameter
            for key, value in param_state.items():
                if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() \
                        and not isinstance(value, DTensor):
                    param_state[key] = DTensor.from_local(value, param.device_mesh, param.placements,
                                                          shape=param.shape, stride=param.stride())
        torch.set_rng_state(state["rng"])

    def checksum(self) -> str:
        """CRC-32 of this rank's parameter shards: equal across groups when their parameters are bitwise equal."""
        value = 0
        for param in self.model.parameters():
            value = zlib.crc32(local(param).detach().contiguous().reshape(-1).view(torch.uint8).numpy(), value)
        return f"{value:08x}"
