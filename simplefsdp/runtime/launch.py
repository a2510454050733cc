"""Launching local ranks through PyTorch's elastic launcher (the engine behind ``torchrun``)."""

from __future__ import annotations

import os
import sys
import uuid


def is_launched_rank() -> bool:
    """True inside a process started by ``torchrun`` / ``torch.distributed.run``."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch_local_ranks(nproc: int, module_argv: list[str]) -> int:
    """Run ``python -m simplefsdp <module_argv>`` on ``nproc`` local ranks; return the job's exit code.

    Same rendezvous as ``torchrun --standalone``. A failed rank ends the job: the
    launcher stops the others and this names the rank. Each rank gets an equal
    share of the CPU cores unless ``OMP_NUM_THREADS`` is set.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "simplefsdp", *module_argv)
    except ChildFailedError as failure:
        rank, first = failure.get_first_failure()
        print(f"simplefsdp: rank {rank} failed (exit code {first.exitcode}); the job stopped", file=sys.stderr)
        return 1
    return 0
