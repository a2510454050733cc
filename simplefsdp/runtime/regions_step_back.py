"""Where a model's blocks fail to compile as regions (in Dynamo, AOTAutograd or Inductor), compile it again: with a
region per value of the setting their compute read, else as the whole graph, saying so once."""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from simplefsdp.runtime.block_regions import READ_SETTING
from simplefsdp.runtime.compiled_call import set_compiled_call


def whole_graph_where_regions_fail(model: nn.Module, uninstall: Callable[[], None],
                                   regions_keyed_by: Callable[[frozenset[str]], Callable[[], None] | None],
                                   compile_whole_graph: Callable[[], None], say: Callable[[str], None],
                                   keyed: frozenset[str] = frozenset()) -> None:
    """Make a call of ``model`` (compiled with regions by default) whose compile fails in Dynamo, AOTAutograd or
    Inductor ``uninstall`` the regions and run again, saying so once: with a region per value of a setting the compute
    read as well (``regions_keyed_by`` installs and compiles them, or returns None where they would be too many), else
    as the whole graph (``compile_whole_graph``). Compiles fail alike on every rank (the same graph, the same torch),
    so every rank steps back at the same call."""
    compiled = model._compiled_call_impl

    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except Exception as error:
            if (reason := compiler_failure(error)) is None:
                raise
        uninstall()
        read = re.search(READ_SETTING, reason)
        if read and read[1] not in keyed and (uninstall_keyed := regions_keyed_by(keyed | {read[1]})) is not None:
            whole_graph_where_regions_fail(model, uninstall_keyed, regions_keyed_by, compile_whole_graph, say,
                                           keyed | {read[1]})
            say(f"compile_blocks_once: the blocks differ in {read[1]!r}, which their compute reads: compiling a region "
                "per value of it")
        else:
            compile_whole_graph()
            say(f"compile_blocks_once could not compile this model's blocks as regions ({reason[:300]}); compiling "
                "the whole graph instead. Pass compile_blocks_once=False to skip the attempt.")
        return model._compiled_call_impl(*args, **kwargs)

    set_compiled_call(model, call)


def compiler_failure(error: BaseException) -> str | None:
    """Why the compile failed, in a line, where ``error``, or one it was raised from, is Dynamo's or Inductor's (they
    wrap AOTAutograd's) or was raised in their code (a bare assertion of Dynamo's); else None. Not Dynamo's recompile
    limit (``runtime/compile.py`` raises it on purpose: on that rank alone, a whole graph would issue collectives the
    other ranks' graphs do not)."""
    compiler, innermost = False, error
    while innermost is not None:
        if isinstance(innermost, torch._dynamo.exc.FailOnRecompileLimitHit):
            return None
        compiler = compiler or any(module.startswith(("torch._dynamo", "torch._inductor"))
                                   for module in (type(innermost).__module__, _raised_in(innermost)))
        error, innermost = innermost, getattr(innermost, "inner_exception", None) or innermost.__cause__
    if not compiler:
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    # our own reason (``_unreadable``) where Dynamo wraps it, else torch's first line (and the next, where the first
    # announces it: "Got graph break/error:"), or where it was raised (a bare ``assert``)
    first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0] or f"raised in {_raised_in(error)}"
    return next((line for line in lines if "compile_blocks_once" in line), f"{type(error).__name__}: {first}")


def _raised_in(error: BaseException) -> str:
    """The module whose code raised ``error`` (its traceback's innermost frame); empty where it was never raised."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame.tb_frame.f_globals.get("__name__", "") if frame is not None else ""
