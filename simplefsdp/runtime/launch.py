"""Launching local ranks through PyTorch's elastic launcher (the engine behind ``torchrun``)."""

from __future__ import annotations

import os
import signal
import sys
import uuid


def is_launched_rank() -> bool:
    """True inside a process started by ``torchrun`` / ``torch.distributed.run``."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch_local_ranks(nproc: int, module_argv: list[str]) -> int:
    """Run ``python -m simplefsdp <module_argv>`` on ``nproc`` local ranks like ``torchrun --standalone``; exit code."""
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
        print(f"simplefsdp: {describe_failures(failure.failures)}; the job stopped", file=sys.stderr)
        return 1
    return 0


def describe_failures(failures: dict) -> str:
    """Name the failed ranks, the likely cause first: killed by a signal, then errors (often a collective broken by
    the dead peer), last the ranks the launcher stopped with SIGTERM after the first failure."""

    def likely_cause_first(item):
        rank, failure = item
        return (failure.exitcode == -signal.SIGTERM, failure.exitcode >= 0, failure.timestamp, rank)

    ordered = sorted(failures.items(), key=likely_cause_first)
    parts = [f"rank {rank} {'was killed by ' + failure.signal_name() if failure.exitcode < 0 else 'failed'} "
             f"(exit code {failure.exitcode})" for rank, failure in ordered]
    return parts[0] + (f", then {', '.join(parts[1:])}" if parts[1:] else "")
