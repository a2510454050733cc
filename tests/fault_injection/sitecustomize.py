"""Test-only fault injection, active when this folder is on PYTHONPATH of a launched job.

``SIMPLEFSDP_TEST_KILL=<rank>:<point>:<n>`` makes that rank SIGKILL itself on the
n-th call of the point: ``optimizer-step`` (``torch.optim.AdamW.step``) or
``checkpoint-write`` (DCP's ``FileSystemWriter.write_data``, mid-save).
"""

import os
import signal

_spec = os.environ.get("SIMPLEFSDP_TEST_KILL", "")
if _spec and os.environ.get("RANK") == _spec.split(":")[0]:
    import torch.distributed.checkpoint as dcp
    import torch.optim

    _, _point, _nth = _spec.split(":")
    _owner, _name = {
        "optimizer-step": (torch.optim.AdamW, "step"),
        "checkpoint-write": (dcp.FileSystemWriter, "write_data"),
    }[_point]
    _original = getattr(_owner, _name)
    _calls = 0

    def _killing(*args, **kwargs):
        global _calls
        _calls += 1
        if _calls == int(_nth):
            os.kill(os.getpid(), signal.SIGKILL)
        return _original(*args, **kwargs)

    setattr(_owner, _name, _killing)
