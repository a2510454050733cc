"""Inductor's check of this CPU's vector instruction sets, done once per machine instead of once per process: once
every check has passed, a marker in ``SIMPLEFSDP_CACHE`` lets later processes set ``cpp.vec_isa_ok`` (what it saves
and why: ``ARCHITECTURE.md``, "Caches"). Private: ``torch._inductor.cpu_vec_isa`` and ``cpp_builder``."""

from __future__ import annotations

import contextlib
import hashlib
import platform

import torch
from torch._inductor import config as inductor_config
from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker

from simplefsdp.ir.hardware import CACHE_DIR


def check_vector_isas_once_per_machine() -> None:
    """Set ``cpp.vec_isa_ok`` where this machine's vector ISAs all passed Inductor's check before, else check them
    now (as Inductor would) and record it when they pass; only on x86-64 without CUDA, where nobody set it."""
    if inductor_config.cpp.vec_isa_ok is not None or platform.machine() != "x86_64" or torch.cuda.is_available():
        return
    flags = x86_isa_checker()
    machine = repr((platform.node(), torch.__version__, flags, get_compiler_version_info(get_cpp_compiler())))
    marker = CACHE_DIR / f"vec-isa-{hashlib.sha256(machine.encode()).hexdigest()[:32]}"
    if not marker.exists():
        reported = [isa for isa in supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]
        if not all(reported):  # bool() of a VecISA is Inductor's check: build and load a test library
            return
        with contextlib.suppress(OSError):  # a cache directory that is not writable: check again next time
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(machine)
    inductor_config.cpp.vec_isa_ok = True
