"""A default that cannot run a model steps back to the path that works, saying so in one line; asked for explicitly,
the same thing is an error that names the fix. ``compile_blocks_once=None`` here; the zoo (``test_zoo``) trains the
models of issue 62 at real depth under every default."""

from __future__ import annotations

import contextlib
import copy
import io
import re

import pytest
import torch
from torch import nn
from torch._dynamo.utils import compilation_time_metrics

import simplefsdp
from ranks import run_on_ranks
from simplefsdp.api import blocks_once_by_default
from simplefsdp.models.llama import build_model
from simplefsdp.passes.bucket_plan import find_blocks
from test_block_regions import ReluBlock, SineBlock, _compiles_blocks_once
from zoo import ComplexRotaryLlama, ResNet, build


class RunningSumBlock(nn.Module):
    """Scales its input; adds the input's values to a buffer in place, which torch 2.13's regions refuse in training
    (found only when AOTAutograd traces the region: no refusal of ours sees it)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.detach().sum())
        return x * self.scale


class IndexedBlock(nn.Module):
    """Scales its input by a weight, then by ``factor``, read by a function outside its class (as Hugging Face's
    attention functions read their module's settings); holds its ``index``, which its compute never reads (as a
    Hugging Face layer's ``layer_idx`` without a cache)."""

    def __init__(self, index: int, factor: float) -> None:
        super().__init__()
        self.index, self.factor = index, factor
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _times_factor(self, x)


def _times_factor(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x * block.scale * block.factor


class FactorReadByItsForward(IndexedBlock):
    """An ``IndexedBlock`` whose forward reads ``self.factor`` itself (as Gemma's attention its ``sliding_window``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale * self.factor


class WithUnusedWeight(nn.Module):
    """Scales its input by a weight; holds another that its forward never reads (as Longformer's layers their
    global-attention projections without a global mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.unused = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class PicksWithAWeight(WithUnusedWeight):
    """Scales its input by a weight where another weight picks (the top 4 of 8 of its product with the input): the
    picking weight gets no gradient, as an indexer's of DeepSeek-V3.2's sparse attention (Hunyuan V4's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale * torch.zeros_like(x).scatter(-1, (x * self.unused).topk(4).indices, 1.0)


def _blocks_with_an_unused_weight(x: torch.Tensor, whole: torch.Tensor, block: type = WithUnusedWeight) -> dict:
    """``block``s compiled by default, as ``_compiled_by_default`` reads them, then trained one backward on this rank's
    rows ``x`` of ``whole``: which parameters got a gradient, and whether those are the unsharded blocks' on
    ``whole``."""
    torch.manual_seed(0)
    model = nn.Sequential(block(), block())
    reference = copy.deepcopy(model)
    result = _compiled_by_default(model, x)
    model(x.detach().requires_grad_()).sum().backward()
    reference(whole.detach().requires_grad_()).sum().backward()
    return {**result, "grads": [parameter.grad is not None for parameter in model.parameters()],
            "grads_equal": all(torch.equal(p.grad.full_tensor() * 2, q.grad)  # as in _step_back_on_a_failed_region
                               for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None)}


def _step_back_on_a_failed_region() -> dict:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(RunningSumBlock(), RunningSumBlock())
    reference = nn.Sequential(RunningSumBlock(), RunningSumBlock())
    reference.load_state_dict(model.state_dict())
    simplefsdp.compile_sharded(model)
    regions_installed = _compiles_blocks_once(model)
    x = torch.ones(2, 8, requires_grad=True)  # whole numbers: the buffers' sums are exact; an input that requires
    # grad makes the region one of training
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        output = model(x[rank:rank + 1].detach().requires_grad_())
    output.sum().backward()
    expected = reference(x.detach().requires_grad_())
    expected.sum().backward()
    model(x[rank:rank + 1].detach().requires_grad_())  # a second call runs the whole graph, and says nothing
    return {"transposing": _blocks_that_read_their_inputs_attribute(x[rank:rank + 1]),
            "settings": {(block.__name__, factors): _blocks_that_differ_in_a_setting(block, factors, x[rank:rank + 1])
                         for block, factors in ((IndexedBlock, (2.0, 2.0, 2.0)), (IndexedBlock, (2.0, 4.0, 2.0)),
                                                (IndexedBlock, (2.0, 4.0, 2.0, 4.0)),
                                                (FactorReadByItsForward, (2.0, 4.0, 2.0, 4.0)))},
            "strided": _compiled_by_default(_strided_blocks(1, 2, 1, 2), torch.ones(1, 4, 16, 16)),
            "unused": _blocks_with_an_unused_weight(x[rank:rank + 1], x),
            "picking": _blocks_with_an_unused_weight(x[rank:rank + 1], x, PicksWithAWeight),
            "installed": regions_installed, "after": _compiles_blocks_once(model), "said": said.getvalue(),
            "output": torch.equal(output, expected[rank:rank + 1]),
            "grads": all(torch.equal(p.grad.full_tensor() * 2, q.grad)  # the ranks' mean of sums, the whole batch's sum
                         for p, q in zip(model.parameters(), reference.parameters())),
            "seen": [block.seen.item() for block in model.children()]}


def _blocks_that_differ_in_a_setting(block: type[IndexedBlock], factors: tuple[float, ...], x: torch.Tensor) -> dict:
    """``block``s with ``factors``, as ``_compiled_by_default`` reads them (products of powers of 2 and one rounding
    each: exact in any kernel)."""
    torch.manual_seed(0)
    return _compiled_by_default(nn.Sequential(*map(block, range(len(factors)), factors)), x)


def _compiled_by_default(model: nn.Module, x: torch.Tensor) -> dict:
    """``model`` compiled by default and called on ``x``: whether its blocks run as regions, how often Dynamo traced
    one, what rank 0 said, and whether the output is exactly the unsharded model's."""
    reference = copy.deepcopy(model)
    simplefsdp.compile_sharded(model)
    compilation_time_metrics.clear()
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        output = model(x)
    return {"regions": _compiles_blocks_once(model), "traced": len(compilation_time_metrics.get(
        "invoke_subgraph_trace", ())), "said": said.getvalue(), "exact": torch.equal(output, reference(x))}


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_on_ranks(2, _step_back_on_a_failed_region)


def test_a_region_torch_cannot_build_steps_back_to_the_whole_graph_on_every_rank(per_rank):
    """Blocks alike, so regions by default; AOTAutograd refuses the region (a buffer updated in place): every rank
    compiles the whole graph instead and runs the call, rank 0 saying so once. The step is exact: an elementwise
    product, and each gradient the mean of two ranks' one-row contributions (one fp32 add and a halving, exact; the
    reference's the add alone). The
    failed attempt ran nothing: the first block's buffer summed its two calls' inputs, 8 ones each, not more."""
    for rank, result in enumerate(per_rank):
        assert result["installed"] and not result["after"], result
        assert result["output"] and result["grads"], result
        assert result["seen"][0] == 16.0, result
        lines = result["said"].splitlines()
        if rank == 0:
            assert len(lines) == 1 and "compiling the whole graph instead" in lines[0], lines
            assert "in-place" in lines[0], lines  # torch's reason, in its first line
        else:
            assert lines == [], lines


def test_blocks_holding_a_weight_they_never_read_compile_once_and_leave_it_without_a_gradient(per_rank):
    """A region is handed every parameter of its block, gathered, also one its compute never reads (XLNet, Longformer):
    the blocks run as regions with nothing said, the output exact (an elementwise product), the unused weights without
    a gradient, as under FSDP2, the others the unsharded blocks' (exact, as in the step-back test above). So too where
    the compute reads the weight into integers alone (top-k positions: ``PicksWithAWeight``)."""
    for unused in [result[key] for result in per_rank for key in ("unused", "picking")]:
        assert unused["regions"] and unused["exact"] and unused["said"] == "", unused
        assert unused["grads"] == [True, False, True, False] and unused["grads_equal"], unused


def test_inspect_traces_blocks_holding_a_weight_they_never_read_as_regions_and_gathers_only_what_they_read():
    """``inspect`` drops a region's unread inputs as ``compile_sharded`` does (``ir/capture.py: compiling_regions``):
    the blocks are regions, with no step back, and the forward gathers each block's read weight alone (``scale``'s 8
    fp32 elements), not the unread one beside it."""
    report = simplefsdp.inspect(nn.Sequential(*(WithUnusedWeight() for _ in range(3))), (torch.zeros(2, 8),),
                                world_size=2)
    assert report.notes == ()
    forward = report.stage("traced").forward
    assert re.findall(r"invoke_subgraph\(\w+, '(\w+)'", forward.code), forward.code
    assert [node.collective.bytes for node in forward.nodes if node.collective] == [8 * 4] * 3


def test_what_regions_cannot_run_is_the_whole_graph_by_default_and_an_error_when_asked(fake_world, capfd):
    """A block with a forward set on its instance (a region runs the class's, and would lose it): by default the model
    is compiled as a whole graph, with one line saying why; ``compile_blocks_once=True`` raises before any
    collective, its last line naming the fix."""
    reason = "'layers.1' has a forward of its own"
    model = simplefsdp.compile_sharded(_own_forward(build_model("debug", n_layers=2)))
    assert not _compiles_blocks_once(model)
    said = capfd.readouterr().err.splitlines()
    assert [line for line in said if line.startswith("simplefsdp:")] == [
        line for line in said if reason in line and "compiling the whole graph" in line], said
    with pytest.raises(ValueError, match=reason) as error:
        simplefsdp.compile_sharded(_own_forward(build_model("debug", n_layers=2)), compile_blocks_once=True,
                                   backend="aot_eager")
    assert str(error.value).endswith("pass compile_blocks_once=False")


class InPlaceBlock(nn.Module):
    """Doubles its input in place, then multiplies it by a weight: a region's input is a leaf that requires grad (the
    second block's, an activation), which autograd does not let an op update in place; the whole graph's is an
    activation, which it does."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2) @ self.weight


def test_inspect_steps_back_from_regions_torch_refuses_as_compile_sharded_does():
    """Blocks that fail as regions in torch 2.13: ``inspect`` by default traces the whole graph, the same graphs as
    ``compile_blocks_once=False``, with a note saying why."""
    torch.manual_seed(0)
    inputs = (torch.randn(4, 8),)
    report = simplefsdp.inspect(nn.Sequential(*(InPlaceBlock() for _ in range(3))), inputs, world_size=2)
    whole = simplefsdp.inspect(nn.Sequential(*(InPlaceBlock() for _ in range(3))), inputs, world_size=2,
                               compile_blocks_once=False)
    (note,) = [note for note in report.notes if "traced as the whole graph" in note]
    assert "in-place operation" in note
    assert report.summary().replace(f"note: {note}\n", "") == whole.summary()


class TransposingBlock(nn.Module):
    """Multiplies its input's transpose's transpose by a weight: torch 2.13's Dynamo records the attribute read of a
    region's input that no op has touched (``x.mT``) in the outer graph, and then asserted as it reused the region
    (pytorch/pytorch#191785), until regions read their inputs through an alias. Weights of whole numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randint(-2, 3, (8, 8)).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mT.mT @ self.weight


def _blocks_that_read_their_inputs_attribute(x: torch.Tensor) -> dict:
    """Three ``TransposingBlock``s compiled by default, a forward and backward of ``x`` (whole numbers): whether they
    stayed in regions, what was said, and whether output and gradients are exactly the unsharded blocks' (sums and
    products of small whole numbers, and the ranks' mean of two: exact in any order)."""
    torch.manual_seed(0)
    model = nn.Sequential(TransposingBlock(), TransposingBlock(), TransposingBlock())
    reference = copy.deepcopy(model)
    simplefsdp.compile_sharded(model)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        output = model(x.detach().requires_grad_())
    output.sum().backward()
    ranks = torch.distributed.get_world_size()
    reference(torch.cat([x.detach()] * ranks)).sum().backward()
    return {"regions": _compiles_blocks_once(model), "said": said.getvalue(),
            "exact": torch.equal(output, reference(x)) and all(
                torch.equal(p.grad.full_tensor() * ranks, q.grad) for p, q in zip(model.parameters(),
                                                                            reference.parameters()))}


def test_inspect_traces_falcons_blocks_as_regions():
    """Falcon's blocks (40B's layout) read their weights transposed (``self.weight.T``), which regions take (an alias
    of each weight first: ``_region``), and index by a list (``qkv[:, :, :, [-2]]``), which makes a real meta tensor
    while tracing on meta (``ir/capture.py``): ``inspect`` reuses the region traced for the first block (the last
    keeps its gathers: a region of its own) for the second, with no step back."""
    compilation_time_metrics.clear()
    report = simplefsdp.inspect(build("falcon", layers=3), (torch.zeros(2, 16, dtype=torch.long),), world_size=2)
    assert report.notes == ()
    assert compilation_time_metrics["invoke_subgraph_reuse_stamp_out"]


def test_blocks_that_read_their_inputs_attribute_train_in_regions(per_rank):
    """``x.mT`` of a block's input, which torch 2.13's Dynamo asserted on in a region: the blocks stay in regions,
    nothing is said, and the step is exact (``_blocks_that_read_their_inputs_attribute``). From the launch above."""
    for result in per_rank:
        assert result["transposing"] == {"regions": True, "said": "", "exact": True}, result["transposing"]


def test_inspect_traces_complex_rotary_blocks_as_regions():
    """torchtitan's rotary embedding multiplies by a complex buffer, whose backward reads a conjugate view that torch
    2.13 cannot pass between regions: traced as a new tensor (``compiling_regions``), every block calls one region in
    the forward and one in the backward, with no step back."""
    report = simplefsdp.inspect(ComplexRotaryLlama(layers=3), (torch.zeros(2, 16, dtype=torch.long),), world_size=2)
    assert report.notes == ()
    for graph in (report.stage("traced").forward, report.stage("traced").backward):
        calls = re.findall(r"invoke_subgraph\(\w+, '(\w+)'", graph.code)
        assert len(calls) == 3 and len(set(calls)) == 1, calls


def test_inspect_shares_a_region_between_blocks_that_differ_in_a_setting_their_compute_never_reads():
    """By default ``inspect`` traces the regions ``compile_sharded``'s default compiles: Hugging Face's layers, each
    with its own ``layer_idx``, call one region; Gemma 3's, whose attention's forward reads a sliding window that
    differs between its two kinds of layer (every sixth full), call a region per kind, keyed from the start (Dynamo
    inlines a region called once: the full-attention layer's, at 6 layers)."""
    tokens = (torch.zeros(2, 16, dtype=torch.long),)
    report = simplefsdp.inspect(build("llama", layers=3), tokens, world_size=2)
    calls = re.findall(r"invoke_subgraph\(\w+, '(\w+)'", report.stage("traced").forward.code)
    assert len(calls) == 3 and len(set(calls)) == 1, calls
    report = simplefsdp.inspect(build("gemma3", layers=6), tokens, world_size=2)
    calls = re.findall(r"invoke_subgraph\(\w+, '(\w+)'", report.stage("traced").forward.code)
    assert len(calls) == 5 and len(set(calls)) == 1, calls
    assert not [note for note in report.notes if note.startswith("traced as the whole graph")], report.notes


def test_blocks_that_differ_only_in_a_setting_the_compute_never_reads_are_traced_once(per_rank):
    """Blocks alike but for a setting share one region (Hugging Face's ``layer_idx``): their compute is traced once.
    A setting that differs and that a method of the block's class reads (``self.factor``) keys the regions from the
    start where each then serves two blocks on average (Gemma's and gpt-oss's layers alternate sliding-window and full
    attention). Where the compute reads one otherwise (a function of the module reads ``block.factor``), the region
    raises as it is traced; every rank then compiles a region per value of the setting on the same condition, else
    the whole graph, naming the setting. Exact either way (see ``_blocks_that_differ_in_a_setting``). From the launch
    of the test above."""
    for rank, result in enumerate(per_rank):
        unread, read_per_block, read_alternating, read_by_forward = (result["settings"][key] for key in (
            ("IndexedBlock", (2.0, 2.0, 2.0)), ("IndexedBlock", (2.0, 4.0, 2.0)),
            ("IndexedBlock", (2.0, 4.0, 2.0, 4.0)), ("FactorReadByItsForward", (2.0, 4.0, 2.0, 4.0))))
        # no failed attempt: the gathers' region and a compute per value of 'factor', nothing said
        assert read_by_forward["regions"] and read_by_forward["exact"], read_by_forward
        assert read_by_forward["said"] == "" and read_by_forward["traced"] == 3, read_by_forward
        assert unread["regions"] and unread["exact"] and unread["said"] == "", unread
        assert unread["traced"] == 2, unread  # the blocks' compute and the gathers' region, each once
        assert not read_per_block["regions"] and read_per_block["exact"], read_per_block  # 2 values for 3 blocks
        assert read_alternating["regions"] and read_alternating["exact"], read_alternating  # 2 values for 4 blocks
        # the failed attempt's gathers and compute, then the gathers and a compute per value of 'factor'
        assert read_alternating["traced"] == 5, read_alternating
        if rank == 0:
            assert "differ in 'factor' as one region, and the compute reads 'factor'" in read_per_block["said"], (
                read_per_block)
            assert read_alternating["said"].splitlines() == [
                "simplefsdp: compile_blocks_once: the blocks differ in 'factor', which their compute reads: "
                "compiling a region per value of it"], read_alternating
        else:
            assert read_alternating["said"] == "", read_alternating
        # a torch.nn setting that differs (a convolution's stride) keys the regions from the start: nothing said,
        # the gathers' region traced once and each block's compute once (each sees a stride and an input shape of
        # its own); a failed attempt first would add two traces
        strided = result["strided"]
        assert strided["regions"] and strided["exact"] and strided["said"] == "" and strided["traced"] == 5, strided


def _strided_blocks(*strides: int) -> nn.Module:
    """Convolutions with ``strides``, their weights -1, 0 or 1: on whole numbers every sum is a whole number below
    36 ** len(strides) (4 channels x 9 taps per layer), exact in fp32 in any order up to 4 blocks."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Conv2d(4, 4, 3, stride=stride, padding=1, bias=False), nn.ReLU())
                            for stride in strides))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randint(-1, 2, parameter.shape))
    return model


def _own_forward(model: nn.Module) -> nn.Module:
    model.layers[1].forward = lambda *args, **kwargs: type(model.layers[1]).forward(model.layers[1], *args, **kwargs)
    return model


@pytest.mark.parametrize("options, make, once", [
    ({}, lambda: build_model("debug", n_layers=2), True),
    ({"compile_blocks_once": False}, lambda: build_model("debug", n_layers=2), False),
    ({"backend": "aot_eager"}, lambda: build_model("debug", n_layers=2), False),
    ({"backend": "aot_eager", "compile_blocks_once": True}, lambda: build_model("debug", n_layers=2), True),
    ({"compile": False}, lambda: build_model("debug", n_layers=2), False),
    ({"dynamic": True}, lambda: build_model("debug", n_layers=2), False),
    ({}, lambda: _own_forward(build_model("debug", n_layers=2)), False),
    ({}, lambda: nn.Sequential(ReluBlock(), SineBlock(1.0)), False),  # no repeats (the same shapes, not class)
    ({}, lambda: ComplexRotaryLlama(layers=2), True),  # complex tensors: trained in regions in test_zoo
    ({}, lambda: ResNet(layers=2), True),  # batch norms' running statistics: trained in regions in test_zoo
    # blocks that differ in a torch.nn module's setting, which its forward reads: a region per value of it, without
    # a failed attempt first (MobileNetV2's strided blocks), where two blocks share one
    ({}, lambda: _strided_blocks(1, 2, 1, 2), True),
    ({}, lambda: _strided_blocks(1, 2), False),
])
def test_blocks_are_compiled_once_by_default_where_the_model_allows_it(fake_world, options, make, once):
    """``compile_blocks_once=None`` (the default) compiles blocks once when Inductor compiles repeated blocks that a
    region can run; otherwise, and with ``False``, the whole graph, and no error."""
    assert _compiles_blocks_once(simplefsdp.compile_sharded(make(), **options)) is once


def test_tensor_parallel_blocks_are_not_compiled_once_by_default():
    model = build_model("debug", n_layers=2)
    blocks = find_blocks(model)
    assert blocks_once_by_default(model, blocks, tensor_parallel=False, dynamic=False)
    assert not blocks_once_by_default(model, blocks, tensor_parallel=True, dynamic=False)
