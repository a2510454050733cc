"""Launching local ranks through PyTorch's elastic launcher (the engine behind ``torchrun``)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import NoReturn


def is_launched_rank() -> bool:
    """True inside a process started by ``torchrun`` / ``torch.distributed.run``."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def leave_rank(code: int = 0) -> NoReturn:
    """End this rank with ``code``, its output flushed, without the interpreter's finalization or C++ static
    destructors: with PyTorch 2.13 a gloo worker still releasing a collective then aborted a finished rank now and
    then ("terminate called without an active exception"; ``gloo_exit`` has the mechanism), which turned a completed
    run into a failed job. Call it after a barrier, so no rank leaves while another communicates."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch_local_ranks(nproc: int, module_argv: list[str], max_restarts: int = 0) -> int:
    """Run ``python -m simplefsdp <module_argv>`` on ``nproc`` local ranks like ``torchrun --standalone``, restarting
    all of them up to ``max_restarts`` times after a failure; exit code. A rank killed by a crash in C++ (SIGSEGV,
    SIGABRT) prints its threads' Python stacks first (``PYTHONFAULTHANDLER``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=max_restarts, monitor_interval=0.5)
    try:
        elastic_launch(config, sys.executable)("-m", "simplefsdp", *module_argv)
    except ChildFailedError as failure:
        print(f"simplefsdp: {describe_failures(failure.failures)}; the job stopped", file=sys.stderr)
        return 1
    return 0


def start_lighthouse() -> tuple[subprocess.Popen, str]:
    """Start torchft's lighthouse (the ``ft`` extra's ``torchft_lighthouse``) on a free local port: the process
    (``terminate()`` it when done) and its address."""
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([binary, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", "--join_timeout_ms",
                               "60000", "--heartbeat_timeout_ms", "2000"], env={"RUST_LOG": "warn", **os.environ})
    return server, f"http://127.0.0.1:{port}"


def launch_replica_groups(groups: int, nproc: int, module_argv: list[str], lighthouse: str | None) -> int:
    """Start torchft's lighthouse (unless ``lighthouse`` names a running one), then ``python -m simplefsdp <module_argv>
    --replica-group G`` for each of ``groups`` groups of ``nproc`` ranks; the first failing exit code, else 0."""
    server, lighthouse = start_lighthouse() if lighthouse is None else (None, lighthouse)
    threads = str(max(1, (os.cpu_count() or 1) // (groups * nproc)))  # the groups share this machine's cores
    env = {"RUST_LOG": "warn", "OMP_NUM_THREADS": threads, **os.environ, "TORCHFT_LIGHTHOUSE": lighthouse}
    jobs = [subprocess.Popen([sys.executable, "-m", "simplefsdp", *module_argv, "--replica-group", str(group)], env=env)
            for group in range(groups)]
    try:
        codes = [job.wait() for job in jobs]
        return next((code for code in codes if code), 0)
    finally:
        for process in (*jobs, *([server] if server else [])):
            process.terminate()
            process.wait()


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
