"""Exiting a gloo rank without torch 2.13's abort at exit (pytorch/pytorch#190489).

gloo's worker thread drops a finished collective, often just after the rank's wait returned, and the collective holds
Python objects: its tensors, and, if issued during ``backward()``, the ``contextvars.Context`` that ``backward()``
stashes in torch's thread-local state. A worker that waits for the GIL to release them when the interpreter starts
finalizing ends its thread inside a destructor, and the process aborts ("terminate called without an active
exception") after the script's last line: a finished run reported as failed. So at exit, before finalization, the rank
gives the GIL up (10 ms at least) until the collectives of its ``backward()`` calls are released."""

from __future__ import annotations

import atexit
import contextvars
import gc
import time
import types

_PHASE = contextvars.ContextVar("simplefsdp_phase")  # "training" in each copy backward() stashes; "exiting" at exit
_WAIT_S = 5.0  # the longest wait at exit: a collective whose peer is gone, or whose handle Python keeps, stays held


def settle_gloo_collectives_at_exit() -> None:
    """At this process's exit, before finalization, give gloo's workers the GIL until they have dropped every
    collective issued during a ``backward()`` of this thread (at most ``_WAIT_S``); idempotent."""
    if _PHASE.get(None) != "training":
        atexit.register(_wait_for_backward_contexts)
        _PHASE.set("training")


def _wait_for_backward_contexts() -> None:
    _PHASE.set("exiting")  # this thread's own context: not a copy
    deadline = time.monotonic() + _WAIT_S
    while True:
        time.sleep(0.01)  # the GIL free: a worker waiting for it takes it
        if not _held_backward_contexts() or time.monotonic() > deadline:
            return


def _held_backward_contexts() -> int:
    """How many contexts ``backward()`` stashed while training are alive and held by no Python object (by torch's
    thread-local state in a collective, or in the running ``backward()``)."""
    copies = [each for each in gc.get_objects() if type(each) is contextvars.Context and each.get(_PHASE) == "training"]
    held = 0
    for copy in copies:
        held += not [holder for holder in gc.get_referrers(copy)
                     if holder is not copies and not isinstance(holder, types.FrameType)]
    return held
