"""Bucket apply: rewrite an FX graph so each planned bucket becomes one collective on a flat buffer, an all-gather
where its first member was (ARCHITECTURE.md, "Every rank plans the same"), a reduction after its last."""

from __future__ import annotations

import torch
from torch import fx

from simplefsdp.passes.bucket_plan import BucketPlan
from simplefsdp.passes.reorder import needed_after
from simplefsdp.passes.inductor_internals import (bucket_traces_reused, merge_all_gathers, merge_all_reduces,
                                                   merge_all_to_alls, merge_reduce_scatters, topological_sort)


def apply_buckets(graph: fx.Graph, plan: BucketPlan) -> None:
    """Merge each bucket of ``plan`` (more than one collective) in ``graph``, in place."""
    by_name = {node.name: node for node in graph.nodes}
    merge = {"all_gather": merge_all_gathers, "reduce_scatter": merge_reduce_scatters,
             "all_reduce": merge_all_reduces, "all_to_all": merge_all_to_alls}
    with bucket_traces_reused():
        for bucket in (bucket for bucket in plan.buckets if len(bucket.collectives) > 1):
            collectives = [by_name[name] for name in bucket.collectives]
            for collective in collectives:
                _one_wait(graph, collective)
            if bucket.kind == "all_gather":
                for later in collectives[1:]:
                    for node in needed_after(graph, later, collectives[0].prev)[:-1]:
                        collectives[0].prepend(node)
            merge[bucket.kind](graph, collectives)
    topological_sort(graph)


def _one_wait(graph: fx.Graph, collective: fx.Node) -> None:
    """Make the first wait of ``collective`` its one user, as merging expects: it serves the other waits' users (a
    parameter read twice leaves two) and every later node reading the result itself (ARCHITECTURE.md says why)."""
    if len(collective.users) < 2:
        return
    order = {node: index for index, node in enumerate(graph.nodes)}
    waits = sorted((user for user in collective.users if user.target is torch.ops._c10d_functional.wait_tensor.default),
                   key=order.__getitem__)
    for extra in waits[1:]:
        extra.replace_all_uses_with(waits[0])
        graph.erase_node(extra)
    for user in [user for user in collective.users if waits and order[user] > order[waits[0]]]:
        user.replace_input_with(collective, waits[0])
