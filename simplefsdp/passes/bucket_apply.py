"""Bucket apply: rewrite an FX graph so each planned bucket becomes one collective on a flat buffer.

An all-gather bucket gathers where its first all-gather was, a reduce-scatter, all-reduce or all-to-all bucket
reduces after its last one (when all its gradients exist). Every element is reduced with the same peers in the same
order: numerics are bitwise unchanged.
"""

from __future__ import annotations

from torch import fx

from simplefsdp.passes.bucket_plan import BucketPlan
from simplefsdp.passes.inductor_internals import (merge_all_gathers, merge_all_reduces, merge_all_to_alls,
                                                   merge_reduce_scatters, topological_sort)


def apply_buckets(graph: fx.Graph, plan: BucketPlan) -> None:
    """Merge each bucket of ``plan`` (more than one collective) in ``graph``, in place."""
    by_name = {node.name: node for node in graph.nodes}
    merge = {"all_gather": merge_all_gathers, "reduce_scatter": merge_reduce_scatters,
             "all_reduce": merge_all_reduces, "all_to_all": merge_all_to_alls}
    for bucket in (bucket for bucket in plan.buckets if len(bucket.collectives) > 1):
        merge[bucket.kind](graph, [by_name[name] for name in bucket.collectives])
    topological_sort(graph)
