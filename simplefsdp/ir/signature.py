"""A graph's collective signature: what every rank of a group must issue, in order, for the collectives to match.

One line per data-parallel collective, program order: kind, group (its global ranks), element count, dtype, and the
module that issued it. Ranks of one group must produce the same lines for the group's collectives; the digest is the
SHA-256 of the lines, what ranks compare before a graph's first collective (``runtime/rank_agreement.py``)."""

from __future__ import annotations

import ast
import hashlib
import re
from collections import Counter
from typing import Sequence

from simplefsdp.ir.schedule import Schedule, ScheduleNode


def collective_line(node: ScheduleNode) -> str:
    """``node``'s collective as one line: ``all_gather group=(0, 1) elements=4096 dtype=torch.float32 module=...``."""
    collective = node.collective
    elements = collective.bytes // collective.dtype.itemsize
    return (f"{collective.kind} group={collective.group_ranks} elements={elements} dtype={collective.dtype} "
            f"module={node.fqn or '<root>'}")


def collective_lines(schedule: Schedule) -> tuple[str, ...]:
    """The lines of ``schedule``'s data-parallel collectives, program order."""
    return tuple(collective_line(node) for node in schedule.data_parallel_collectives())


def signature_digest(lines: tuple[str, ...]) -> str:
    """SHA-256 (hex) of ``lines``."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def lines_by_group(lines: Sequence[str]) -> dict[tuple[int, ...], tuple[str, ...]]:
    """``lines`` split by the global ranks of their process group, program order kept within each group."""
    grouped: dict[tuple[int, ...], list[str]] = {}
    for line in lines:
        ranks = ast.literal_eval(re.search(r" group=(\([\d, ]*\))", line).group(1))
        grouped.setdefault(ranks, []).append(line)
    return {ranks: tuple(group_lines) for ranks, group_lines in grouped.items()}


def elements_by_kind(lines: Sequence[str]) -> Counter:
    """Elements per (kind, dtype) of collective ``lines``: equal where two plans bucket the same collectives."""
    totals: Counter = Counter()
    for line in lines:
        kind, elements, dtype = re.fullmatch(r"(\S+) group=.* elements=(\d+) dtype=(\S+) module=.*", line).groups()
        totals[kind, dtype] += int(elements)
    return totals
