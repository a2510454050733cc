"""Every rank plans with rank 0's hardware profile, whatever its own would be; a failure on rank 0 reaches all."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from ranks import run_on_ranks

from simplefsdp.ir.hardware import H100
from simplefsdp.runtime import agreed_profile as module


def _profiles_and_failure() -> tuple[str, str]:
    """On each rank: the agreed profile's name when each rank's own differs, then what a failing rank 0 causes."""
    rank = dist.get_rank()
    module.local_profile = lambda device_type: dataclasses.replace(H100, name=f"{device_type} of rank {rank}")
    agreed = module.agreed_profile("cpu").name

    def fail_on_rank_0(device_type):
        if rank == 0:
            raise OSError("disk full")
        return H100

    module.local_profile = fail_on_rank_0
    try:
        module.agreed_profile("cpu")
        failure = "none"
    except (OSError, RuntimeError) as error:
        failure = f"{type(error).__name__}: {error}"
    return agreed, failure


def test_every_rank_gets_rank_0s_profile_and_rank_0s_failure():
    (agreed_0, failure_0), (agreed_1, failure_1) = run_on_ranks(2, _profiles_and_failure)
    assert agreed_0 == agreed_1 == "cpu of rank 0"
    assert failure_0 == "OSError: disk full"
    assert failure_1.startswith("RuntimeError: rank 0 could not get the cpu hardware profile (OSError: disk full)")
