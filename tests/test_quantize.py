"""Low-bit communication: the wire format's round trip, the quantized step on 2 gloo ranks against a hand-computed
exchange, error feedback (a tied weight's: one buffer, one exchange), no-sync and checkpoints, and the quantized
graphs on the fake process group."""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from collectives import CountCollectives
from ranks import run_on_ranks
from scenarios import U
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import Quantize, compile_sharded, load_checkpoint, save_checkpoint
from simplefsdp.ir.capture import capture_graphs
from simplefsdp.passes.bucket_copies import all_to_all_bucket
from simplefsdp.passes.bucket_plan import find_blocks
from simplefsdp.passes.install import OverlapPasses
from simplefsdp.runtime.fake_world import fake_world
from simplefsdp.runtime.quantize import QMAX, error_feedback_state, padded_rows, quantize_pack, unpack_dequantize
from simplefsdp.runtime.replicate_compute import ReplicateComputation
from simplefsdp.runtime.sharding import shard_parameters

BLOCK = 64
QUANTIZE = Quantize(gather="int8", reduce="int4", block_size=BLOCK, beta=0.5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_round_trip_error_is_within_half_a_step_and_packing_is_deterministic(fmt):
    rows = torch.randn(3, 4 * BLOCK, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 3)[:, None]
    rows[1, :BLOCK] = 0  # an all-zero block has scale 0 and comes back exactly
    packed = quantize_pack(rows, fmt, BLOCK)
    codes_per_byte = {"int8": 1, "int4": 2}[fmt]  # and one fp32 scale per block
    assert packed.dtype == torch.uint8 and packed.shape == (3, 4 * 4 + 4 * BLOCK // codes_per_byte)
    error = (unpack_dequantize(packed, fmt, BLOCK) - rows).abs().reshape(3, -1, BLOCK)
    step = rows.abs().reshape(3, -1, BLOCK).amax(-1, keepdim=True) / QMAX[fmt]
    # Rounding to the nearest code is off by half a step; the fp32 division before it and the multiplication
    # after it each add at most u relative to a value of at most qmax steps.
    assert (error <= step * (0.5 + 2 * QMAX[fmt] * U)).all()
    assert error[1, 0].max() == 0
    # The backward's re-gather quantizes the same shard in another compiled graph: the bits must not change; and
    # Inductor's kernels compute as eager (the multi-rank test below runs aot_eager graphs).
    assert torch.equal(torch.compile(quantize_pack)(rows, fmt, BLOCK), packed)
    assert torch.equal(torch.compile(unpack_dequantize)(packed, fmt, BLOCK), unpack_dequantize(packed, fmt, BLOCK))


def test_bad_options_are_refused_before_anything_compiles():
    for options, message in [({"gather": "int4"}, "gather='int4'"), ({"reduce": "fp8"}, "reduce='fp8'"),
                             ({"block_size": 0}, "block_size=0"), ({"beta": 1.0}, "beta=1.0")]:
        with pytest.raises(ValueError, match=message):
            Quantize(**options)
    with pytest.raises(ValueError, match="replicate' gathers no weights"):
        compile_sharded(nn.Linear(2, 2), mode="replicate", quantize=QUANTIZE)
    with pytest.raises(TypeError, match="simplefsdp.Quantize"):
        compile_sharded(nn.Linear(2, 2), quantize="int8")
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="placed twice"):  # each call's backward would add its error
        compile_sharded(nn.Sequential(shared, shared), quantize=QUANTIZE)
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="pass compile=True"):
        compile_sharded(tied, quantize=QUANTIZE, compile=False)


def _hand_exchange(sent, error, quantize=QUANTIZE):
    """The reference exchange: row ``i`` of every rank's ``sent + error`` quantized and decoded on rank ``i``, summed
    there in fp32; returns this rank's sum and its new error buffer."""
    sent = sent + error
    decoded = unpack_dequantize(quantize_pack(sent, quantize.reduce, BLOCK), quantize.reduce, BLOCK)
    everyone = [torch.empty_like(decoded) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, decoded)
    mine = sum(decoded_by[dist.get_rank()] for decoded_by in everyone)
    return mine, quantize.beta * error + (1 - quantize.beta) * (sent - decoded)


def _hand_reduced(local_grad, error, world, replicas=1, quantize=QUANTIZE):
    """The gradient shard of this rank averaged over ``world`` shards, or over the world's ranks as ``replicas`` of
    one shard each (the one-rank exchange skipped); and this rank's new error buffer."""
    values, padded = padded_rows(local_grad.shape, world, BLOCK, replicas)
    rows = torch.zeros(world * values)
    rows[:local_grad.numel()] = local_grad.flatten()
    sent = torch.nn.functional.pad(rows.reshape(world, values), (0, padded - values))
    if replicas == 1:
        mine, new_error = _hand_exchange(sent, error, quantize)
        return mine[:values] / world, new_error
    chunks = sent.reshape(replicas, -1)  # each replica sums its chunk, then every replica decodes every chunk
    reduced, chunk_error = _hand_exchange(chunks, error.reshape(chunks.shape), quantize)
    packed = quantize_pack((reduced / replicas).reshape(1, -1), quantize.reduce, BLOCK)
    everyone = [torch.empty_like(packed) for _ in range(replicas)]
    dist.all_gather(everyone, packed)
    decoded = unpack_dequantize(torch.cat(everyone), quantize.reduce, BLOCK).reshape(-1)
    return decoded[:values], chunk_error.reshape(1, -1)


def _batch(number, rank):
    """Integer inputs and loss weights of step ``number`` on ``rank``."""
    generator = torch.Generator().manual_seed(10 * number + rank)
    return (torch.randint(-3, 4, shape, generator=generator).float() for shape in ((4, 16), (4, 33)))


def _replica_steps(root, mode):
    """``hybrid_shard`` on 2 replicas of 1 shard, or ``replicate`` on 2 ranks (the same exchange): two steps'
    gradients and error buffers, whether every replica holds the same gradient bits, and whether a checkpoint gives
    back the error buffers."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    mesh, quantize = init_device_mesh("cpu", (2, 1) if mode == "hybrid_shard" else (2,)), QUANTIZE
    if mode == "replicate":
        quantize = dataclasses.replace(QUANTIZE, gather=None)
    model = compile_sharded(nn.Linear(16, 33), mesh=mesh, mode=mode, quantize=quantize, backend="aot_eager")
    plain = nn.Linear(16, 33)
    exact = same = True
    for number in (1, 2):
        errors = {name: error.to_local().clone() for name, error in error_feedback_state(model).items()}
        x, weight = _batch(number, rank)
        (model(x) * weight).sum().backward()
        (plain(x) * weight).sum().backward()
        for name, param in model.named_parameters():
            expected, expected_error = _hand_reduced(dict(plain.named_parameters())[name].grad, errors[name], 1, 2)
            exact &= torch.equal(param.grad.to_local().flatten(), expected)
            exact &= torch.equal(error_feedback_state(model)[name].to_local(), expected_error)
            everyone = [torch.empty_like(param.grad.to_local()) for _ in range(2)]
            dist.all_gather(everyone, param.grad.to_local())
            same &= torch.equal(*everyone)
        model.zero_grad()
        plain.zero_grad()
    saved = {name: error.to_local().clone() for name, error in error_feedback_state(model).items()}
    path = save_checkpoint(root, 2, model, torch.optim.SGD(model.parameters(), lr=0.1))
    for error in error_feedback_state(model).values():
        error.to_local().zero_()
    zeroed = all(error.to_local().abs().sum() == 0 for error in error_feedback_state(model).values())
    load_checkpoint(path, model)
    loaded = zeroed and all(torch.equal(error.to_local(), saved[name]) and saved[name].abs().sum() > 0
                 for name, error in error_feedback_state(model).items())
    return exact, same, loaded


class TiedLinears(nn.Module):
    """Two linear layers of one weight (tied, as GPT-2's token embedding and output layer), each on its own input."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 33), nn.Linear(16, 33)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) + self.second(x.flip(-1))


def _step(model, plain, number):
    """Step ``number``'s backward on ``model`` and on ``plain``; the collectives of ``model``'s backward."""
    x, weight = _batch(number, dist.get_rank())
    loss = (model(x) * weight).sum()
    with CountCollectives(any_dtype=True) as counter:
        loss.backward()
    (plain(x) * weight).sum().backward()  # the weight gradient of a linear loss does not depend on the weights
    return dict(counter.counts)


def _two_exact_steps(model, plain, quantize):
    """Steps 1 and 2 with SGD: whether every gradient and error buffer equals ``_hand_reduced`` of ``plain``'s
    gradient bitwise (for a tied weight: one exchange of the sum of its uses' gradients), and the last backward's
    collectives."""
    optimizer, exact = torch.optim.SGD(model.parameters(), lr=0.1), True
    for number in (1, 2):
        errors = {name: error.to_local().clone() for name, error in error_feedback_state(model).items()}
        collectives = _step(model, plain, number)
        for name, param in model.named_parameters():
            expected, expected_error = _hand_reduced(dict(plain.named_parameters())[name].grad, errors[name],
                                                     dist.get_world_size(), quantize=quantize)
            exact &= torch.equal(param.grad.to_local().flatten(), expected[:param.to_local().numel()])
            exact &= torch.equal(error_feedback_state(model)[name].to_local(), expected_error)
        plain.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    return exact, collectives


def _quantized_steps(root):
    """Integer data and a linear loss: each rank's local gradient is exact in any order, so the quantized
    exchange can be compared bitwise with ``_hand_reduced``. Compiled by ``aot_eager`` (Inductor's C++ compiles
    would cost a minute here; its kernels are checked against eager above): one linear layer serves every check but
    the tied weight's, which a compiled call gathers once (eager gathers at every read) and ``TiedLinears`` checks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model, plain = compile_sharded(nn.Linear(16, 33), quantize=QUANTIZE, backend="aot_eager"), nn.Linear(16, 33)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def snapshot(grads=False):
        """Every error buffer and parameter (or gradient) shard of this rank, copied."""
        tensors = [*error_feedback_state(model).values(), *model.parameters()]
        return [(t.grad if grads and t.requires_grad else t).to_local().clone() for t in tensors]

    def equal(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    results = {}
    results["exact"], results["backward_collectives"] = _two_exact_steps(model, plain, QUANTIZE)
    results["error_carried"] = all(e.to_local().abs().sum() > 0 for e in error_feedback_state(model).values())

    saved, at_save = save_checkpoint(root, 2, model, optimizer), snapshot()
    _step(model, plain, 3)
    after_step_3 = snapshot(), snapshot(grads=True)
    optimizer.step()  # moves the weights, as step 3 moved the error buffers
    optimizer.zero_grad()
    load_checkpoint(saved, model, optimizer)
    results["loaded_exact"] = equal(snapshot(), at_save) and not equal(after_step_3[0], at_save)
    _step(model, plain, 3)
    results["resume_exact"] = equal(snapshot(), after_step_3[0]) and equal(snapshot(grads=True), after_step_3[1])

    before = snapshot()
    with model.no_sync():
        results["no_sync_backward_collectives"] = _step(model, plain, 4)
    results["no_sync_errors_unchanged"] = equal(snapshot(), before)

    # The bucketing pass's merged all-to-all moves every byte as the separate ones would.
    functional, splits, group = torch.ops._c10d_functional, [1] * world, dist.group.WORLD.group_name
    generator = torch.Generator().manual_seed(rank)
    inputs = [torch.randint(0, 256, (world, n), dtype=torch.uint8, generator=generator) for n in (3, 5, 8)]
    alone = [functional.wait_tensor(functional.all_to_all_single(t, splits, splits, group)) for t in inputs]
    results["bucket_exact"] = equal(all_to_all_bucket(inputs, splits, splits, group), alone)
    for mode in ("hybrid_shard", "replicate"):
        results[f"{mode}_exact"], results[f"{mode}_replicas_equal"], results[f"{mode}_loaded"] = _replica_steps(
            f"{root}/{mode}", mode)

    int8 = dataclasses.replace(QUANTIZE, reduce="int8")
    tied = compile_sharded(TiedLinears(), quantize=int8, backend="aot_eager")
    results["tied_exact"], collectives = _two_exact_steps(tied, TiedLinears(), int8)
    results["tied_exchanges"] = collectives.get("all_to_all_single", 0), len(list(tied.parameters()))
    results["tied_error_buffers"] = {name: error.to_local().abs().sum().item() > 0
                                     for name, error in error_feedback_state(tied).items()}
    return results


def test_quantized_step_matches_the_hand_computed_exchange(tmp_path):
    for result in run_on_ranks(2, _quantized_steps, str(tmp_path)):
        assert result["exact"]  # gradients and error buffers, bitwise, over two steps
        assert result["error_carried"]
        assert result["backward_collectives"]  # the counter sees the compiled backward's collectives
        # the forward keeps its gathered weights with sync off, so the backward communicates nothing
        assert result["no_sync_backward_collectives"] == {}
        assert result["no_sync_errors_unchanged"]
        assert result["loaded_exact"]  # weights and error buffers as saved, after a step that changed both
        assert result["resume_exact"]  # the step after loading reproduces the step after saving
        assert result["bucket_exact"]
        for mode in ("hybrid_shard", "replicate"):
            assert result[f"{mode}_exact"], mode  # the cross-replica exchange as the hand reference, bitwise
            assert result[f"{mode}_replicas_equal"], mode
            assert result[f"{mode}_loaded"], mode
        # a tied weight (int8 both ways): one error buffer, carried once, and one exchange of the summed gradient
        assert result["tied_exact"]
        assert result["tied_error_buffers"] == {"first.weight": True, "first.bias": True, "second.bias": True}
        exchanges, parameters = result["tied_exchanges"]
        assert exchanges == parameters == 3  # no bucketing under aot_eager: one all-to-all per parameter


def _passed_schedules(quantize, mode="fully_shard", mesh_shape=(8,)):
    """The forward and backward schedules of an MLP with two repeated blocks on 8 fake ranks, after the block
    bucketing and reordering passes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 8))
    passes = OverlapPasses("block", blocks=find_blocks(model))
    shard_parameters(model, init_device_mesh("cpu", mesh_shape), mode, ReplicateComputation(None, None, True, quantize))
    torch._dynamo.reset()
    graphs = capture_graphs(model, (torch.randn(4, 16),))
    return [list(passes.stages(gm, phase))[-1].schedule
            for gm, phase in ((graphs.forward, "forward"), (graphs.backward, "backward"))]


def _kinds(schedule):
    return Counter(node.collective.kind for node in schedule.collectives())


def test_quantized_collectives_bucket_like_full_precision_ones_with_uint8_payloads():
    with fake_world(8):
        full, quantized = _passed_schedules(None), _passed_schedules(QUANTIZE)
        hybrid = _passed_schedules(QUANTIZE, "hybrid_shard", (2, 4))
        replicate = _passed_schedules(dataclasses.replace(QUANTIZE, gather=None), "replicate")
    as_quantized = {"all_gather": "all_gather", "reduce_scatter": "all_to_all"}
    for full_schedule, schedule in zip(full, quantized):
        assert _kinds(schedule) == Counter(as_quantized[node.collective.kind] for node in full_schedule.collectives())
    for schedule in [*quantized, *hybrid, replicate[1]]:
        assert {node.collective.dtype for node in schedule.collectives()} == {torch.uint8}
    # one gradient exchange each for the head (two layers) and the two blocks, not one per parameter (eight)
    assert _kinds(quantized[1])["all_to_all"] == 3
    # hybrid: the same over the shards, then per bucket between the replicas an all-to-all (each replica sums a
    # chunk) and an all-gather of the sums, where full precision has all-reduces (merged by bytes with "block")
    assert _kinds(hybrid[0]) == _kinds(quantized[0])
    assert _kinds(hybrid[1]) == _kinds(quantized[1]) + Counter({"all_to_all": 3, "all_gather": 3})
    # replicate: no all-gather in the forward, and the replicas' exchange alone in the backward
    assert _kinds(replicate[0]) == Counter()
    assert _kinds(replicate[1]) == Counter({"all_to_all": 3, "all_gather": 3})


def _quantized_model_and_optimizer():
    torch.manual_seed(0)
    model = compile_sharded(nn.Linear(16, 33), quantize=QUANTIZE, backend="aot_eager")
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _save_after_one_step(root):
    model, optimizer = _quantized_model_and_optimizer()
    x, weight = _batch(1, dist.get_rank())
    (model(x) * weight).sum().backward()
    optimizer.step()
    save_checkpoint(root, 1, model, optimizer)
    return {name: param.full_tensor() for name, param in model.named_parameters()}


def _resume_and_step(root):
    model, optimizer = _quantized_model_and_optimizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = load_checkpoint(f"{root}/step-00000001", model, optimizer)
    loaded = {name: param.full_tensor() for name, param in model.named_parameters()}
    zero = all(error.to_local().abs().sum() == 0 for error in error_feedback_state(model).values())
    x, weight = _batch(2, dist.get_rank())
    (model(x) * weight).sum().backward()
    optimizer.step()
    carried = all(error.to_local().abs().sum() > 0 for error in error_feedback_state(model).values())
    return step, loaded, [str(w.message) for w in caught], zero, carried


def test_quantized_run_saved_at_4_ranks_resumes_at_2_with_error_feedback_restarted(tmp_path):
    """Error buffers are per-rank rows of the old world's exchange and mean nothing at another world size: they are
    dropped with one warning (error feedback restarts from zero, which is sound); parameters reshard exactly."""
    saved = run_on_ranks(4, _save_after_one_step, str(tmp_path))[0]
    for step, loaded, messages, zero, carried in run_on_ranks(2, _resume_and_step, str(tmp_path)):
        assert step == 1 and zero and carried
        assert all(torch.equal(loaded[name], value) for name, value in saved.items())
        assert sum("error feedback restarts from zero" in message for message in messages) == 1, messages
