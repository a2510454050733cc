"""gloo's reduce-scatters as all-to-alls (``passes/gloo_reduce_scatter.py``): planned on gloo groups alone, rewritten
into an all-to-all, its wait and the sum, with the values of the reduce-scatter. The same rewrite on 2 and 4 gloo ranks
trains as one process does in ``test_parity``, ``test_zoo`` and the other multi-rank tests (every compiled backward
on gloo runs it)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from simplefsdp.ir.schedule import read_schedule
from simplefsdp.passes.gloo_reduce_scatter import apply_gloo_reduce_scatters, plan_gloo_reduce_scatters

functional = torch.ops._c10d_functional


def reduce_scatter_then_scale(group_size: int):
    group_name = dist.group.WORLD.group_name

    def step(gradient: torch.Tensor) -> torch.Tensor:
        reduced = functional.wait_tensor(functional.reduce_scatter_tensor(gradient, "avg", group_size, group_name))
        return reduced * 2

    return step


def targets(gm: torch.fx.GraphModule) -> set:
    return {node.target for node in gm.graph.nodes if node.op == "call_function"}


def test_a_gloo_reduce_scatter_becomes_an_all_to_all_and_a_sum_of_the_same_values(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        step = reduce_scatter_then_scale(1)
        gm = make_fx(step, tracing_mode="fake")(torch.empty(6, 3))
        (name,) = plan_gloo_reduce_scatters(read_schedule(gm, "backward"))
        assert gm.graph.find_nodes(op="call_function", target=functional.reduce_scatter_tensor.default)[0].name == name
        apply_gloo_reduce_scatters(gm.graph, (name,))
        gm.recompile()
        assert functional.reduce_scatter_tensor.default not in targets(gm)
        assert functional.all_to_all_single.default in targets(gm)
        gradient = torch.randn(6, 3)
        assert torch.equal(gm(gradient), step(gradient))  # one rank: the sum of one chunk, bitwise
    finally:
        dist.destroy_process_group()


def test_no_other_backend_is_rewritten(fake_world):
    gm = make_fx(reduce_scatter_then_scale(8), tracing_mode="fake")(torch.empty(16, 3))
    assert plan_gloo_reduce_scatters(read_schedule(gm, "backward")) == ()
