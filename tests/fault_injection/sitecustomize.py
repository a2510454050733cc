"""Test-only fault injection, active when this folder is on PYTHONPATH of a launched job.

``SIMPLEFSDP_TEST_KILL=<rank>:<point>:<n>[:<group>]`` makes that rank (of replica group ``<group>``, when given)
SIGKILL itself (or send itself ``SIMPLEFSDP_TEST_SIGNAL``, such as ``SIGSEGV``) on the n-th call of the point, in
the job's first run only (not after an elastic restart): ``step-end`` (``torch.optim.Optimizer.zero_grad``, after
the optimizer stepped, any optimizer), ``checkpoint-write`` (DCP's ``FileSystemWriter.write_data``, mid-save),
``cross-replica`` (torchft's ``Manager.allreduce``: the other
groups' all-reduce is under way) or ``cross-replica-gather`` (torchft's gloo group's ``allgather``, DeMo's exchange).
``SIMPLEFSDP_TEST_STEP_SLEEP=<seconds>`` makes every step's ``zero_grad`` that long, so that a short run outlasts a
restart.
"""

import os
import signal
import time
from pathlib import Path

if _sleep := float(os.environ.get("SIMPLEFSDP_TEST_STEP_SLEEP", "0")):
    from torch.optim import Optimizer as _Optimizer

    _zero_grad = _Optimizer.zero_grad
    _Optimizer.zero_grad = lambda *args, **kwargs: (time.sleep(_sleep), _zero_grad(*args, **kwargs))[1]

_spec = os.environ.get("SIMPLEFSDP_TEST_KILL", "").split(":")
_command = Path("/proc/self/cmdline").read_bytes().split(b"\0")
if (len(_spec) > 2 and os.environ.get("RANK") == _spec[0] and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        and (len(_spec) == 3
             or [b"--replica-group", _spec[3].encode()] in [_command[i:i + 2] for i in range(len(_command))])):
    _, _point, _nth = _spec[:3]
    if _point == "cross-replica":
        from torchft.manager import Manager as _owner
    elif _point == "cross-replica-gather":
        from torchft.process_group import ProcessGroupGloo as _owner
    elif _point == "step-end":
        from torch.optim import Optimizer as _owner
    else:
        from torch.distributed.checkpoint import FileSystemWriter as _owner
    _name = {"step-end": "zero_grad", "checkpoint-write": "write_data", "cross-replica": "allreduce",
             "cross-replica-gather": "allgather"}[_point]
    _original = getattr(_owner, _name)
    _calls = 0

    def _killing(*args, **kwargs):
        global _calls
        _calls += 1
        if _calls == int(_nth):
            os.kill(os.getpid(), signal.Signals[os.environ.get("SIMPLEFSDP_TEST_SIGNAL") or "SIGKILL"])
        return _original(*args, **kwargs)

    setattr(_owner, _name, _killing)
