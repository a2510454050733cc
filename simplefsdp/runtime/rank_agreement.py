"""Ranks agreeing before collectives run: the same model on every rank, the same collectives in every compiled graph.

The model check all-gathers over a mesh's dimensions (``gather_over_mesh``, no process group created); a graph's
check all-reduces a digest per dimension. Digests go first, full data only when they differ; every rank then raises
the same ``ValueError``, so no rank is left waiting in a collective that a rank which raised never joins."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Hashable, Mapping, NoReturn, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.fx.node import has_side_effect
from torch.utils import _pytree as pytree

from simplefsdp.ir.schedule import process_group
from simplefsdp.ir.signature import elements_by_kind, lines_by_group, signature_digest

T = TypeVar("T")

# (lines, group names) of the compiled graphs this process has run, each with what every call of the graph
# all-reduces over each of its mesh dims' process groups (``_difference_seen``).
GRAPHS: dict[tuple[str, str], list[tuple[dist.ProcessGroup, torch.Tensor]]] = {}


def gather_over_mesh(value: T, groups: Sequence[dist.ProcessGroup]) -> dict[int, T]:
    """Every rank's ``value``, by global rank, over the mesh whose dimensions' process groups (this rank's) are
    ``groups``: one object all-gather per dimension, of all the values known so far."""
    known = {dist.get_rank(): value}
    for group in groups:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, known, group=group)
        known = {rank: theirs for part in gathered for rank, theirs in part.items()}
    return known


def agreement_groups(mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> tuple[str, ...]:
    """The names of the process groups of the dimensions of the mesh whose ranks run the compiled graphs (``mesh``'s,
    and tensor parallelism's ``tp_mesh``); empty where no rank can disagree: a world of one rank, or the fake process
    group (``inspect``, graph tests), whose collectives move no data."""
    meshes = [mesh] if tp_mesh is None else [mesh, tp_mesh]
    groups = [each.get_group(dim) for each in meshes for dim in range(each.ndim)]
    if dist.get_backend(groups[0]) == "fake" or math.prod(dist.get_world_size(group) for group in groups) == 1:
        return ()
    return tuple(group.group_name for group in groups)


def _first_difference(theirs: Sequence[str], first: Sequence[str], rank: int, first_rank: int) -> tuple[int, str]:
    """The index where ``theirs`` (``rank``'s) first differs from ``first`` (``first_rank``'s), and both entries
    there ("nothing" past the end of one)."""
    common = min(len(theirs), len(first))
    index = next((i for i in range(common) if theirs[i] != first[i]), common)
    mine, reference = (entries[index] if index < len(entries) else "nothing" for entries in (theirs, first))
    return index, f"{mine} on rank {rank}, {reference} on rank {first_rank}"


def check_same_model_on_all_ranks(module: nn.Module, mesh: DeviceMesh, arguments: Mapping[str, Any] | None = None
                                  ) -> None:
    """Compare ``arguments`` (``compile_sharded``'s, as ``name=repr``) and parameter/buffer names, shapes and dtypes
    across the mesh; raise the same ``ValueError`` on every rank if any differ, naming the lowest rank that differs
    from the mesh's first rank, and the first difference (an error here, on every rank, not a later hang)."""
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    arguments = arguments or {}
    mine = [f"argument {name}={value!r}" for name, value in arguments.items()]
    mine += [f"parameter {n} {tuple(p.shape)} {p.dtype}" for n, p in module.named_parameters(remove_duplicate=False)]
    mine += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    if len(set(gather_over_mesh(hashlib.sha256(repr(mine).encode()).hexdigest(), groups).values())) == 1:
        return
    fingerprints = gather_over_mesh(mine, groups)
    first = min(fingerprints)
    rank = min(r for r, fingerprint in fingerprints.items() if fingerprint != fingerprints[first])
    index, detail = _first_difference(fingerprints[rank], fingerprints[first], rank, first)
    if index < len(arguments):
        raise ValueError(f"compile_sharded's arguments differ between rank {rank} and rank {first}: {detail}; pass "
                         "the same arguments on every rank (they decide which collectives every rank issues)")
    raise ValueError(f"the model differs between rank {rank} and rank {first}: {detail}; "
                     "build the same model (same config) on every rank before compile_sharded")


def same_input_shapes(args: tuple, kwargs: dict, group_names: Sequence[str]) -> bool:
    """Whether every rank of the mesh whose dimensions' groups are ``group_names`` calls with inputs of one structure
    and one shape each: one object all-gather per mesh dimension."""
    groups = [process_group(name) for name in group_names]
    return len(set(gather_over_mesh(input_shapes(args, kwargs), groups).values())) == 1


def input_shapes(args: tuple, kwargs: dict) -> str:
    """The structure of a call's inputs and the shape of each tensor among them, as a string."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return repr((spec, [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]))


def _first_disagreement(by_rank: Mapping[int, Mapping[tuple[int, ...], Hashable]]
                        ) -> tuple[tuple[int, ...], int, int] | None:
    """The first group (sorted) whose member ranks hold different values, with the lowest differing member and the
    group's lowest member; ``None`` when every group agrees. A member that holds nothing for the group differs."""
    for group in sorted({group for values in by_rank.values() for group in values}):
        members = [rank for rank in sorted(group) if rank in by_rank]
        reference = by_rank[members[0]].get(group)
        differing = next((rank for rank in members[1:] if by_rank[rank].get(group) != reference), None)
        if differing is not None:
            return group, differing, members[0]
    return None


def _digest_pairs(lines: Sequence[str], groups: Sequence[dist.ProcessGroup]
                  ) -> list[tuple[dist.ProcessGroup, torch.Tensor]]:
    """For each of ``groups``, the pair (d, -d) of the digest d of the ``lines`` on it, on the group's device."""
    by_group = lines_by_group(lines)
    pairs = []
    for group in groups:
        digest = int(signature_digest(by_group.get(tuple(dist.get_process_group_ranks(group)), ()))[:15], 16)
        device = "cpu" if dist.get_backend(group) == "gloo" else torch.accelerator.current_accelerator()
        pairs.append((group, torch.tensor([digest, -digest], device=device)))  # 60 bits: -digest fits an int64
    return pairs


SEEN = 1 << 61  # added to a pair by a rank that saw a difference: lifts the group's maxima past every 60-bit digest


def _difference_seen(pairs: Sequence[tuple[dist.ProcessGroup, torch.Tensor]]) -> bool:
    """Whether, at this call, the ranks of some group of the mesh run graphs with different collectives on it, the
    same answer on every rank: an all-reduce (max) of each pair of ``_digest_pairs``, then one more per group of all
    but the last dimension carrying ``SEEN`` (why: ``ARCHITECTURE.md``, "The cross-rank guard")."""
    seen = False
    for group, pair in [*pairs, *((group, torch.zeros_like(pair)) for group, pair in pairs[:-1])]:
        reduced = pair + SEEN if seen else pair.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        highest, minus_lowest = reduced.tolist()
        seen = seen or highest >= SEEN // 2 or highest != -minus_lowest
    return seen


def raise_for_difference(lines: Sequence[str], groups: Sequence[dist.ProcessGroup]) -> NoReturn:
    """Raise the same ``ValueError`` on every rank of the mesh spanned by ``groups``, each rank running a graph with
    the collective ``lines``, once every rank has seen that they differ: one object all-gather of the lines per mesh
    dimension, then the first group whose members differ, and its first differing collective."""
    everyone = gather_over_mesh(lines_by_group(lines), groups)
    group, rank, first = _first_disagreement(everyone)  # digests differ only where lines do
    theirs, reference = everyone[rank].get(group, ()), everyone[first].get(group, ())
    index, detail = _first_difference(theirs, reference, rank, first)
    where = f"collective {index} on process group {group} is {detail} (module: the first module in it)"
    if elements_by_kind(theirs) == elements_by_kind(reference):
        raise ValueError(f"ranks planned different buckets for the same collectives: {where}. Running them would hang "
                         "or exchange the wrong bytes. buckets='auto' prices compute from each rank's input shapes, so "
                         "ranks whose inputs differ in shape (a sequence length of their own) can plan differently: "
                         "pass buckets='block' or buckets=None, which plan from the model alone, or give every rank "
                         "inputs of one shape (if they had one shape, report this with the model)")
    raise ValueError(f"ranks ran compiled graphs with different collectives at the same call: {where}. Every rank must "
                     "call the model the same way, step by step. A forward on some ranks only (evaluation on rank 0 "
                     "alone), a backward or optimizer step skipped on one rank (a batch skipped for its loss), or a "
                     "model called on one rank only would hang or exchange the wrong bytes in the graphs' collectives")


@torch.library.custom_op("simplefsdp::agree_on_collectives", mutates_args=())
def agree_on_collectives(lines: str, group_names: str) -> torch.Tensor:
    """Check, at every call, that the ranks of the mesh whose dimensions' groups are ``group_names`` (comma-separated)
    run a graph with the collective ``lines`` (newline-separated) now (``_difference_seen``), and raise the same
    ``ValueError`` on every rank where they do not. Returns an empty tensor for the graph's collectives to depend on."""
    if (lines, group_names) not in GRAPHS:
        groups = [process_group(name) for name in group_names.split(",")]
        GRAPHS[lines, group_names] = _digest_pairs(lines.split("\n"), groups)
    pairs = GRAPHS[lines, group_names]
    if _difference_seen(pairs):
        raise_for_difference(lines.split("\n"), [group for group, _ in pairs])
    return torch.empty(0)


@agree_on_collectives.register_fake
def _(lines: str, group_names: str) -> torch.Tensor:
    return torch.empty(0)


# Its output only orders the collectives after it: marked as having a side effect, so no pass or scheduler drops it.
has_side_effect(torch.ops.simplefsdp.agree_on_collectives.default)
