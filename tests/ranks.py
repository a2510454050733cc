"""Run a function on N local gloo ranks and collect what each rank returns."""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from simplefsdp.runtime.launch import leave_rank


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def apply_simulated_simdlen() -> None:
    """``SIMPLEFSDP_TEST_SIMDLEN=N``: Inductor's C++ kernels use N-bit vectors (1: scalar), as on another CPU.

    ``torch._inductor.config.cpp.simdlen`` has no environment variable of its own; ``ATEN_CPU_CAPABILITY``
    moves eager ATen and Inductor together, this moves Inductor alone. Called in every test process.
    """
    if "SIMPLEFSDP_TEST_SIMDLEN" in os.environ:
        import torch._inductor.config

        torch._inductor.config.cpp.simdlen = int(os.environ["SIMPLEFSDP_TEST_SIMDLEN"])


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, environment: dict, fn: Callable,
               args: tuple) -> None:
    os.environ.clear()  # the caller's environment, not the fork server's of its start
    os.environ.update(environment)
    # A rank killed by a signal (a crash in C++: SIGSEGV, SIGABRT from glibc's heap checks), and each rank the launcher
    # then stops with SIGTERM, prints every thread's Python stack to the test's captured stderr: where each rank was,
    # which the launcher's "terminated with signal" does not say.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    apply_simulated_simdlen()
    # One intra-op thread per rank: Inductor's CPU kernels that add by atomics from several threads (the embedding's
    # backward) sum in no fixed order, and the bitwise checks compare runs. It also keeps N ranks to N threads.
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        outcome = ("ok", fn(*args))
        dist.barrier()  # no rank leaves while another still communicates
    except BaseException:  # reported to the parent, which re-raises
        outcome = ("error", f"rank {rank}: {traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as file:
        pickle.dump(outcome, file)
    # gloo's teardown aborted a rank now and then after its result was written (the zoo's, in CI on 2026-12-03)
    leave_rank(0 if outcome[0] == "ok" else 1)


# Ranks are forked from a server that imported these once (about 7 s of a rank's start-up on 2 cores, which every
# spawned rank paid again); modules that read the environment at import see the server's, taken at its start.
mp.set_forkserver_preload(["torch", "torch._inductor.compile_fx", "torch.distributed.tensor"])


def run_on_ranks(world_size: int, fn: Callable, *args: Any) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` new gloo ranks, in this process's environment; return each rank's result,
    rank order.

    Any rank's exception is re-raised here with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        stopped = None
        try:
            mp.start_processes(
                _rank_main, args=(world_size, _free_port(), out_dir, dict(os.environ), fn, args), nprocs=world_size,
                start_method="forkserver"
            )
        except ProcessException as failure:  # a rank that failed: its own traceback is in its result file
            stopped = failure
        outcomes = [_outcome(out_dir, rank, stopped) for rank in range(world_size)]
    errors = [detail for status, detail in outcomes if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [detail for _, detail in outcomes]


def _outcome(out_dir: str, rank: int, stopped: ProcessException | None) -> tuple[str, Any]:
    """What ``rank`` reported; a rank stopped before reporting is an error that says how: killed by a signal (a crash
    in C++; its threads' Python stacks are in the captured stderr) or by the launcher once another rank failed."""
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as file:
            return pickle.load(file)
    if stopped is not None and stopped.error_index == rank:
        return "error", f"rank {rank}: {stopped}, before it reported"
    return "error", f"rank {rank}: stopped before it finished (another rank failed first)"
