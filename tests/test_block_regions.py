"""``compile_blocks_once``: each block's compute is one call of a region shared by its repeats; the collectives stay in
the outer graphs, bucketed and reordered as the whole-graph path's.

Graphs on the fake process group in one process; the numerics against the single-process reference are
``test_parity``'s ``blocks-once`` jobs (2 gloo ranks, tied and untied weights)."""

import copy
import functools
import itertools
import re
from collections import Counter
from typing import Callable

import pytest
import torch
from ranks import run_on_ranks
from torch import nn
from torch._dynamo.utils import compilation_time_metrics, counters

import simplefsdp
from simplefsdp.models.llama import build_model
from simplefsdp.runtime.block_regions import _run_block
from simplefsdp.runtime.mixed_precision import MixedPrecision

LAYERS = 4


def inspect_debug(compile_blocks_once: bool, **options):
    torch.manual_seed(0)
    model = build_model("debug", n_layers=LAYERS)
    return simplefsdp.inspect(model, (torch.zeros(1, 128, dtype=torch.long),), world_size=8, hardware="h100",
                              mp_policy=MixedPrecision(torch.bfloat16, torch.float32),
                              compile_blocks_once=compile_blocks_once, **options)


@pytest.fixture(scope="module")
def reports():
    """The whole-graph path and compile_blocks_once; and how often Dynamo traced a region's compute or stamped out
    one traced before ("dynamo")."""
    whole = inspect_debug(False)
    compilation_time_metrics.clear()
    once = inspect_debug(True)
    dynamo = {key: len(compilation_time_metrics.get(key, ()))
              for key in ("invoke_subgraph_trace", "invoke_subgraph_reuse_stamp_out")}
    return {False: whole, True: once, "dynamo": dynamo}


def unit(fqn: str) -> str:
    """The block of ``fqn`` (``layers.3`` of ``layers.3.attention.wq``), or ``fqn`` outside the blocks."""
    return ".".join(fqn.split(".")[:2]) if fqn.startswith("layers.") else fqn


def collectives(schedule) -> Counter:
    """How many collectives of each block (or module outside the blocks), kind, bytes and dtype."""
    return Counter((unit(node.fqn), node.collective.kind, node.collective.bytes, str(node.collective.dtype))
                   for node in schedule.collectives())


def block_runs(schedule) -> list[tuple[str, str]]:
    """The blocks' collectives in program order as runs of (block, kind)."""
    rows = [(unit(node.fqn), node.collective.kind) for node in schedule.collectives()]
    return [key for key, _ in itertools.groupby(row for row in rows if row[0].startswith("layers."))]


def test_every_block_calls_the_one_region(reports):
    """As traced, each block is one ``invoke_subgraph`` of one subgraph; after reordering (which pins some nodes in
    ``control_deps``) still one call per block."""
    for schedule in reports[True].stage("traced").schedules:
        calls = re.findall(r"invoke_subgraph\(\w+, '(\w+)'", schedule.code)
        assert len(calls) == LAYERS and len(set(calls)) == 1, (schedule.phase, calls)
    for once, whole in zip(reports[True].schedules, reports[False].schedules):
        assert sum(node.op == "invoke_subgraph" for node in once.nodes) == LAYERS
        assert not any(node.op == "invoke_subgraph" for node in whole.nodes)


def test_the_written_graphs_hold_each_region_body_once_named_as_its_calls_name_it(reports, tmp_path):
    """What ``inspect`` writes shows a block's compute (issue 65): each stage's graphs hold every body their calls
    name, once; the forward's body holds the flash kernel (h100, meta), once; the summary names the blocks served."""
    paths = [path for path in reports[True].save(tmp_path) if path.suffix == ".py"]
    for path in paths:
        code = path.read_text()
        headers = re.findall(r"^# self\.(\w+), the region called by (.*):$", code, re.MULTILINE)
        named = {name for name, _ in headers} | set(re.findall(r"via self\.(\w+)", "".join(c for _, c in headers)))
        # each call: the body it names, or the subgraph that pins it (Inductor's control_deps), by attribute name
        attribute = dict(re.findall(r"^    (\w+) = self\.(\w+)$", code, re.MULTILINE))
        sites = [attribute[site] for site in re.findall(r"invoke_subgraph\((\w+), '", code) + [
            site for site in re.findall(r"control_deps\(\([^)]*\), (\w+),", code) if "invoke_subgraph" in site]]
        assert len(headers) == len({name for name, _ in headers}) == 1, path  # one body, written once
        assert len(sites) >= LAYERS and set(sites) <= named, path
    forward = (tmp_path / "forward.py").read_text()
    assert forward.count("aten._scaled_dot_product_flash_attention.default(") == 1 and "for_cpu" not in forward
    assert f"the compute of {LAYERS} block(s), layers.0 to layers.{LAYERS - 1}" in reports[True].summary()


def test_dynamo_traces_the_compute_of_a_block_once_and_stamps_out_its_repeats(reports):
    """Dynamo's own reuse check traced every block (``functional_call`` swaps the template's tensors, a side effect
    it refuses): a block's Python ran once per block instead of once. Two regions, each traced once: the blocks'
    compute, and the gathers (inlined into the outer graph before AOTAutograd) of every block but the last, which
    keeps its gathered parameters for the backward and gathers outside the region."""
    assert reports["dynamo"] == {"invoke_subgraph_trace": 2, "invoke_subgraph_reuse_stamp_out": 2 * LAYERS - 3}


def test_the_collectives_stay_outside_named_by_their_block(reports):
    """Every gather and reduction is in the outer graph, where the passes bucket and reorder them: the whole graph's
    collectives, each named by its block (a block's reads are gathered before its region, in the block's own module)
    or as before outside the blocks."""
    whole, once = reports[False].stage("traced"), reports[True].stage("traced")
    for whole_schedule, once_schedule in zip(whole.schedules, once.schedules):
        assert collectives(once_schedule) == collectives(whole_schedule)
        names = {node.fqn for node in once_schedule.collectives()}
        assert {f"layers.{index}" for index in range(LAYERS)} <= names
        assert not [name for name in names if name.startswith("layers.") and name.count(".") > 1]


def test_the_backward_gathers_each_block_again_just_before_its_gradients(reports):
    """Resharded after forward: the backward gathers a block's parameters right before the block's backward region
    and reduce-scatters its gradients after it, block by block, last block first (not all gathered up front). The
    last block, whose backward runs first, keeps its parameters gathered from the forward (torchtitan's default)."""
    runs = block_runs(reports[True].stage("traced").backward)
    assert runs == [(f"layers.{LAYERS - 1}", "reduce_scatter")] + [
        (f"layers.{index}", kind) for index in reversed(range(LAYERS - 1)) for kind in ("all_gather", "reduce_scatter")]


def test_a_region_saves_no_more_than_the_whole_graph_and_is_priced_as_its_nodes(reports):
    """The backward's inputs (what forward saves) are no larger than the whole graph's; the predicted step is the
    whole graph's within 5% (a region costs what its nodes cost; the plans differ where the whole graph's buckets
    split a block by module)."""
    whole, once = reports[False], reports[True]
    assert sum(i.bytes for i in once.backward.inputs) <= sum(i.bytes for i in whole.backward.inputs)
    assert once.prediction.step_time == pytest.approx(whole.prediction.step_time, rel=0.05)


def test_the_passes_bucket_each_block_whole(reports):
    """Auto bucketing on the regions' schedule: each block's gathers and reductions in one bucket of their own."""
    final = reports[True]
    for plan in (final.stage("bucketed").forward_plan, final.stage("bucketed").backward_plan):
        text = str(plan)
        for index in range(LAYERS):
            assert f" layers.{index}: 9 collective(s) [layers.{index}]" in text, text


def test_a_region_costs_the_flops_of_its_compute(reports):
    """The schedule counts a region's FLOPs from its subgraph (the cost model prices overlap from them): the matmuls
    and attention are the whole graph's, exactly (PyTorch's formulas on the same shapes)."""
    for whole, once in zip(reports[False].schedules, reports[True].schedules):
        assert sum(node.flops for node in once.nodes) == sum(node.flops for node in whole.nodes) > 0


def test_tensor_parallel_and_dynamic_blocks_are_refused_before_any_collective():
    with pytest.raises(ValueError, match="compile_blocks_once does not run tensor-parallel blocks yet"):
        inspect_debug(True, tp=2)
    with pytest.raises(ValueError, match="compile_blocks_once with dynamic=True fails in torch 2.13's Dynamo"):
        inspect_debug(True, dynamic=True)


def test_a_block_with_a_forward_of_its_own_is_refused_before_any_collective(fake_world):
    """A region runs the block's class forward; one set on the instance (other than checkpointing's) would be lost."""
    model = nn.Sequential(ReluBlock(), ReluBlock())
    model[1].forward = lambda x: x
    with pytest.raises(ValueError, match="'1' has a forward of its own .*: make it a method of the class"):
        simplefsdp.compile_sharded(model, compile_blocks_once=True, backend="aot_eager")


def _compiles_blocks_once(model: nn.Module) -> bool:
    return any(isinstance(vars(module).get("forward"), functools.partial) and module.forward.func is _run_block
               for module in model.modules())


def _calls_a_region_cannot_run() -> list[tuple[float, float]]:
    """Blocks compiled once by default and called with what a region cannot run (an object argument; modules in two
    modes): the largest difference from the same blocks unsharded, called directly (eager) and through the model
    compiled by Inductor, and the bound on the compiled one; then blocks that return ``(hidden, None)``, compiled once
    by Inductor."""
    torch.manual_seed(0)
    extra = object()
    model, x = PairModel(extra), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    simplefsdp.compile_sharded(model)
    differences = [((model.layers[0](x, extra)[0] - reference.layers[0](x, extra)[0]).abs().max().item(), 0.0)]
    compiled = model(x)
    differences.append(((compiled - reference(x)).abs().max().item(), _two_linear_bound(reference, x)))
    model.layers[1].linear.eval()  # a block with modules in both modes: each block's own forward
    reference.layers[1].linear.eval()
    differences.append(((model.layers[1](x)[0] - reference.layers[1](x)[0]).abs().max().item(), 0.0))
    torch.manual_seed(0)
    pairs = PairModel(None)  # blocks that return (hidden, None): compiled once, the call rebuilds the pair
    reference = copy.deepcopy(pairs)
    simplefsdp.compile_sharded(pairs)
    differences.append(((pairs(x) - reference(x)).abs().max().item(), _two_linear_bound(reference, x)))
    return differences


def _two_linear_bound(model: "PairModel", x: torch.Tensor) -> float:
    """How far two fp32 evaluations of relu(W2 relu(W1 x + b1) + b2) may differ: each linear's sum of 8 products and
    a bias within gamma_9 = 9u / (1 - 9u) of exact (Higham, Theorem 3.5) times |W||x| + |b| either way, and layer 1's
    difference carried through |W2| (relu is 1-Lipschitz)."""
    gamma = 9 * 2.0**-24 / (1 - 9 * 2.0**-24)
    first, second = model.layers[0].linear, model.layers[1].linear
    hidden = torch.relu(first(x))
    error = 2 * gamma * (x.abs() @ first.weight.abs().T + first.bias.abs())
    total = error @ second.weight.abs().T + 2 * gamma * ((hidden.abs() + error) @ second.weight.abs().T
                                                          + second.bias.abs())
    return total.max().item()


def test_calls_a_region_cannot_run_run_the_blocks_own_forward_by_default():
    """By default a call with an argument a region cannot key, or a block in two modes, is not an error: the block's
    own forward gathers each parameter as it reads it. Directly: bitwise the unsharded block (eager, the same ops on
    the gathered weights); compiled by Inductor: within two fp32 evaluations' rounding, as are blocks that return a
    constant beside their tensor. On 2 gloo ranks."""
    for rank in run_on_ranks(2, _calls_a_region_cannot_run):
        for difference, bound in rank:
            assert difference <= bound, rank


def test_checkpointed_blocks_recompute_inside_their_region():
    """A checkpointed block checkpoints its compute inside its region (numerics: ``test_activation_checkpointing``):
    full keeps less for backward than selective, and selective less than none, as in the whole graph."""
    peaks = {mode: inspect_debug(True, activation_checkpointing=mode).prediction.memory.peak_by_category["activations"]
             for mode in ("none", "selective", "full")}
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


class ReluBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class SineBlock(ReluBlock):  # the same parameters, another compute
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.linear(x)) * self.scale


class DropoutBlock(ReluBlock):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.relu(self.linear(x)))


def _blocks_of_two_kinds_and_modes() -> tuple[float, float]:
    """The largest difference from the same model unsharded, sharded with ``compile_blocks_once``: of a model of
    alternating blocks of two kinds with the same parameter shapes (and of one kind with two settings); and of a
    model of dropout blocks, in eval mode after a training step."""
    torch.manual_seed(0)
    model = nn.Sequential(ReluBlock(), SineBlock(3.0), ReluBlock(), SineBlock(0.5), ReluBlock(), SineBlock(3.0))
    x = torch.randn(4, 8)
    expected = model(x)
    simplefsdp.compile_sharded(model, compile_blocks_once=True, backend="aot_eager")
    kinds = (model(x) - expected).abs().max().item()
    dropout = nn.Sequential(DropoutBlock(), DropoutBlock()).eval()
    expected = dropout(x)
    simplefsdp.compile_sharded(dropout.train(), compile_blocks_once=True, backend="aot_eager")
    dropout(x).sum().backward()
    return kinds, (dropout.eval()(x) - expected).abs().max().item()


def test_blocks_of_two_kinds_with_the_same_shapes_each_run_their_own_compute_in_their_own_mode():
    """Each kind, and each setting of a kind (``scale``), gets its region; a region reused for another would compute
    relu where sine is due, or the wrong scale. Each mode too: after training, eval mode drops nothing (a region
    traced in training mode would). On 2 gloo ranks with ``aot_eager``: the same ops as eager on the gathered
    weights, so bitwise."""
    assert run_on_ranks(2, _blocks_of_two_kinds_and_modes) == [(0.0, 0.0), (0.0, 0.0)]


def test_a_block_in_two_modes_at_once_is_refused_naming_the_fix(fake_world):
    model = simplefsdp.compile_sharded(nn.Sequential(DropoutBlock(), DropoutBlock()), compile_blocks_once=True,
                                       backend="aot_eager")
    model[1].dropout.eval()
    with pytest.raises(Exception, match="'1' has modules in training and in eval mode: call .train"):
        model(torch.randn(4, 8))


class PairBlock(ReluBlock):
    def forward(self, x: torch.Tensor, extra: object = None) -> tuple:
        return torch.relu(self.linear(x)), extra


class PairModel(nn.Module):
    def __init__(self, extra: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PairBlock() for _ in range(2))
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, self.extra)[0]
        return x


def test_blocks_that_take_other_objects_are_refused_naming_the_fix(fake_world):
    """With ``True`` a block takes only tensors and constants: Dynamo keys a traced block by their values."""
    model = simplefsdp.compile_sharded(PairModel(object()), compile_blocks_once=True, backend="aot_eager")
    with pytest.raises(Exception, match="passes a block only tensors and constants .*; 'layers.0' got a object: stop "
                                        "passing it .* or pass compile_blocks_once=False"):
        model(torch.randn(4, 8))


class NestedOutputBlock(ReluBlock):
    """Returns ``(hidden, None, bias)``, or ``(hidden, {"mean": ...}, bias)`` with ``stats``: one region, two output
    structures; ``bias`` is its own input, passed on as T5's blocks pass on their position bias."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor, stats: bool = False) -> tuple:
        hidden = torch.relu(self.linear(x)) + bias
        return hidden, ({"mean": hidden.mean()} if stats else None), bias


class NestedOutputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NestedOutputBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = x.mean(0)
        for index, layer in enumerate(self.layers):
            x, stats, bias = layer(x, bias, stats=index % 2 == 1)
            if stats is not None:
                x = x - stats["mean"]
        return x


def _blocks_once_difference(build: Callable[[], nn.Module]) -> tuple[float, int]:
    """The largest difference between ``build()``'s model unsharded and sharded with ``compile_blocks_once``, over
    two calls, and how many graphs the second call compiled."""
    torch.manual_seed(0)
    model = build()
    x = torch.randn(4, 8)
    expected = model(x)
    simplefsdp.compile_sharded(model, compile_blocks_once=True, backend="aot_eager")
    first = (model(x) - expected).abs().max().item()
    graphs_before = counters["stats"]["unique_graphs"]
    second = (model(x) - expected).abs().max().item()
    return max(first, second), counters["stats"]["unique_graphs"] - graphs_before


def test_blocks_may_return_constants_nested_tensors_and_their_inputs():
    """A region returns only tensors it computed; the call rebuilds ``(hidden, None, bias)`` and
    ``(hidden, {"mean": ...}, bias)`` from the structure recorded for its reuse key, ``bias`` being the block's input
    (Dynamo refuses a region that returns its input). The blocks alternate: the third block is traced after the
    second, and the fourth reuses the second's trace, so a structure recorded per region instead of per key would give
    the fourth block ``None`` where its mean is due. The second call compiles nothing: Dynamo would otherwise guard on
    the recorded structures as they were before the first trace, and compile the model again. Bitwise, as
    ``aot_eager`` runs eager's ops on the gathered weights (2 gloo ranks)."""
    assert run_on_ranks(2, _blocks_once_difference, NestedOutputModel) == [(0.0, 0), (0.0, 0)]


class ScaledBlock(ReluBlock):
    def forward(self, x: torch.Tensor, pair: tuple, *, scale: float) -> torch.Tensor:
        return torch.relu(self.linear(x)) * pair[0] * scale + pair[1] * pair[1].dim()


class ScaledModel(nn.Module):
    """Blocks of one region called with a nested argument and keywords that differ between blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ScaledBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = (x.new_full((8,), 2.0), x.new_full((8,), -1.0))
        for index, layer in enumerate(self.layers):
            x = layer(x, pair, scale=1.0 + index % 2)
            pair = (pair[0], x.mean(0, keepdim=True))  # another shape: [8], then [1, 8]
        return x


def test_blocks_reuse_a_traced_region_only_for_the_same_arguments():
    """A region's traced code is reused only for the same keywords' values and nested arguments of the same shapes:
    reused for another ``scale`` or shape of ``pair[1]`` (whose ``dim()`` is traced as a constant), the blocks would
    compute the wrong values: each of the two fails this test when the key leaves it out. Bitwise, as
    ``aot_eager`` runs eager's ops on the gathered weights (2 gloo ranks)."""
    assert run_on_ranks(2, _blocks_once_difference, ScaledModel) == [(0.0, 0), (0.0, 0)]
