"""gloo's collectives in their faster forms (``passes/gloo_collectives.py``): planned on gloo groups alone; a
reduce-scatter rewritten into an all-to-all, its wait and the sum, an all-gather (a bucket's or a lone one) into
broadcasts filling one buffer, each with the values of the collective it replaces. The same rewrites on 2 and 4 gloo
ranks train as one process does in ``test_parity``, ``test_zoo`` and the other multi-rank tests (every compiled graph
on gloo runs them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from simplefsdp.ir.schedule import pinned, read_schedule
from simplefsdp.passes.bucket_copies import all_gather_bucket
from simplefsdp.passes.gloo_collectives import apply_gloo_collectives, plan_gloo_collectives
from simplefsdp.passes.rank_guard import insert_agreement
from tests.ranks import run_on_ranks

functional = torch.ops._c10d_functional
by_broadcasts = torch.ops.simplefsdp.all_gather_by_broadcasts.default


def reduce_scatter_then_scale(group_size: int):
    group_name = dist.group.WORLD.group_name

    def step(gradient: torch.Tensor) -> torch.Tensor:
        reduced = functional.wait_tensor(functional.reduce_scatter_tensor(gradient, "avg", group_size, group_name))
        return reduced * 2

    return step


def gather_then_scale(group_size: int):
    group_name = dist.group.WORLD.group_name

    def step(shard: torch.Tensor) -> torch.Tensor:
        return functional.wait_tensor(functional.all_gather_into_tensor(shard, group_size, group_name)) * 2

    return step


def gather_a_bucket(group_size: int):
    """Two parameters' shards gathered as the bucketing pass traces a bucket, then used."""
    group_name = dist.group.WORLD.group_name

    def step(first: torch.Tensor, second: torch.Tensor) -> list[torch.Tensor]:
        rank = dist.get_rank()
        return [p * 2 for p in all_gather_bucket([first, second], group_name, group_size, rank, first.dtype)]

    return step


def targets(gm: torch.fx.GraphModule) -> set:
    return {node.target for node in gm.graph.nodes if node.op == "call_function"}


def rewritten(step, *inputs: torch.Tensor, phase: str = "forward") -> torch.fx.GraphModule:
    """``step`` traced, its one collective planned and rewritten."""
    gm = make_fx(step, tracing_mode="fake")(*inputs)
    (name,) = plan_gloo_collectives(read_schedule(gm, phase))
    apply_gloo_collectives(gm.graph, (name,))
    gm.recompile()
    return gm


def one_gloo_rank(tmp_path) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)


def test_a_gloo_reduce_scatter_becomes_an_all_to_all_and_a_sum_of_the_same_values(tmp_path):
    one_gloo_rank(tmp_path)
    try:
        step = reduce_scatter_then_scale(1)
        gm = rewritten(step, torch.empty(6, 3), phase="backward")
        assert functional.reduce_scatter_tensor.default not in targets(gm)
        assert functional.all_to_all_single.default in targets(gm)
        gradient = torch.randn(6, 3)
        assert torch.equal(gm(gradient), step(gradient))  # one rank: the sum of one chunk, bitwise
    finally:
        dist.destroy_process_group()


def test_a_gloo_all_gather_and_a_bucket_become_broadcasts_with_no_copy_in(tmp_path):
    one_gloo_rank(tmp_path)
    try:
        lone = gather_then_scale(1)
        gm = rewritten(lone, torch.empty(3, 4))
        assert targets(gm) >= {by_broadcasts, functional.wait_tensor.default}
        assert functional.all_gather_into_tensor.default not in targets(gm)
        shard = torch.randn(3, 4)
        assert torch.equal(gm(shard), lone(shard))

        bucket = gather_a_bucket(1)
        gm = rewritten(bucket, torch.empty(3, 4), torch.empty(5))
        assert by_broadcasts in targets(gm)
        assert not targets(gm) & {functional.all_gather_into_tensor_out.default,
                                  torch.ops.simplefsdp.all_gather_copy_in.default}
        first, second = torch.randn(3, 4), torch.randn(5)
        assert all(map(torch.equal, gm(first, second), bucket(first, second)))
    finally:
        dist.destroy_process_group()


def _gathered_both_ways() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per form (a lone shard, a bucket of two shards of different shapes): what the rewritten graph gathers and what
    gloo's all-gather does, on this rank. Each rank's shards differ and differ in value from the other rank's."""
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    shard, first, second = (torch.randn(shape, generator=generator) for shape in ((3, 4), (2, 5), (7,)))
    lone, bucket = gather_then_scale(size), gather_a_bucket(size)
    return [(rewritten(lone, torch.empty(3, 4))(shard), lone(shard)),
            *zip(rewritten(bucket, torch.empty(2, 5), torch.empty(7))(first, second), bucket(first, second))]


def test_broadcasts_gather_what_gloos_all_gather_does_on_two_ranks():
    """A copy moves values unchanged: the two forms agree bitwise on every rank (the broadcasts read each rank's own
    place in the buffer at run time, the graph being the same on every rank)."""
    for pairs in run_on_ranks(2, _gathered_both_ways):
        assert len(pairs) == 3 and all(torch.equal(ours, gloos) for ours, gloos in pairs)


def test_no_other_backend_is_rewritten(fake_world):
    gm = make_fx(reduce_scatter_then_scale(8), tracing_mode="fake")(torch.empty(16, 3))
    assert plan_gloo_collectives(read_schedule(gm, "backward")) == ()
    gm = make_fx(gather_then_scale(8), tracing_mode="fake")(torch.empty(2, 3))
    assert plan_gloo_collectives(read_schedule(gm, "forward")) == ()


def test_a_collective_read_unwaited_is_left_as_traced(tmp_path):
    """A gathered tensor the graph also returns unwaited (torch 2.14's partitioner saves one so) keeps gloo's
    all-gather: its readers expect the collective's own output."""
    one_gloo_rank(tmp_path)
    try:
        group_name = dist.group.WORLD.group_name

        def step(shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            gathered = functional.all_gather_into_tensor(shard, 1, group_name)
            return functional.wait_tensor(gathered) * 2, gathered

        gm = make_fx(step, tracing_mode="fake")(torch.empty(3, 4))
        assert plan_gloo_collectives(read_schedule(gm, "forward")) == ()
    finally:
        dist.destroy_process_group()


def test_the_guard_pins_each_broadcast_gather_after_the_collective_before_it(tmp_path):
    """Inductor keeps its own collectives in the graph's order but may move an opaque op to lower its peak memory,
    differently on ranks whose shards differ in size (a LoRA model's ranks broadcast a bucket on one and token ids on
    the other: gloo aborted): the guard pins each of ours after the collective before it, and the next after it."""
    one_gloo_rank(tmp_path)
    try:
        group_name = dist.group.WORLD.group_name

        def step(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
            reduced = functional.wait_tensor(functional.all_reduce(first, "sum", group_name))
            gathered = functional.wait_tensor(functional.all_gather_into_tensor(second, 1, group_name))
            return reduced.sum() + functional.wait_tensor(functional.all_reduce(gathered, "sum", group_name)).sum()

        gm = rewritten(step, torch.empty(4), torch.empty(3, 2))
        insert_agreement(gm, read_schedule(gm, "forward"), (group_name,))
        pins = [(inner_target(node), [inner_target(dep) for dep in node.args[0]]) for node in gm.graph.nodes
                if pinned(node)]
        agree, all_reduce = torch.ops.simplefsdp.agree_on_collectives.default, functional.all_reduce.default
        assert pins == [(all_reduce, [agree]), (by_broadcasts, [agree, all_reduce]),
                        (all_reduce, [agree, by_broadcasts])]
    finally:
        dist.destroy_process_group()


def inner_target(node: torch.fx.Node):
    """The op ``node`` runs, through a pin."""
    if not pinned(node):
        return node.target
    subgraph = getattr(node.graph.owning_module, node.args[1].target).graph
    return next(inner.target for inner in subgraph.nodes if inner.op == "call_function")
