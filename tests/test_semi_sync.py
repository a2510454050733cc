"""``--replica-sync demo`` and ``diloco``: their arithmetic in one process, against references built without their
code (a momentum made of DCT basis functions written out with ``math.cos``; torch's own Nesterov SGD; rounding by
hand), and ``inspect``'s price of each; then across two real replica groups of one gloo rank
(``test_fault_tolerance``'s setup): what agrees, the bytes, healing and resuming."""

from __future__ import annotations

import math
import platform
import re
import shutil

import pytest
import torch

from test_inspect import inspect_debug
from test_train_cli import _load_full, assert_same_checkpoint, train
from simplefsdp.models.llama import build_model
from simplefsdp.optim import DeMo, DiLoCo
from simplefsdp.optim.demo import largest_divisor
from simplefsdp.optim.diloco import packed_bytes, quantized_mean
from simplefsdp.runtime.checkpoint import checkpoint_path

SYNC = {"demo": ["--replica-sync", "demo"], "diloco": ["--replica-sync", "diloco", "--sync-every", "4"]}
DILOCO_INT4 = [*SYNC["diloco"], "--outer-quantize", "int4"]
torchft_wheels = pytest.mark.skipif(platform.machine() != "x86_64", reason="torchft 0.2.0 publishes x86-64 wheels only")

EPS = 2.0**-24  # fp32's unit roundoff


def basis_function(size: int, i: int, j: int) -> torch.Tensor:
    """The orthonormal 2-D DCT-II basis function of frequencies (i, j) on a size x size chunk, in float64."""
    def vector(k: int) -> list[float]:
        scale = math.sqrt((1 if k == 0 else 2) / size)
        return [scale * math.cos(math.pi * (n + 0.5) * k / size) for n in range(size)]
    return torch.tensor(vector(i), dtype=torch.float64)[:, None] * torch.tensor(vector(j), dtype=torch.float64)


class TwoGroups:
    """The collectives of group ``index`` of two, whose peer sends ``peer_payload``; records what this group sends."""

    def __init__(self, index: int, peer_payload: torch.Tensor | None) -> None:
        self.index, self.peer_payload, self.sent = index, peer_payload, None

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.sent = tensor.clone()
        peer = self.peer_payload if self.peer_payload is not None else torch.zeros_like(tensor)
        return [tensor, peer] if self.index == 0 else [peer, tensor]


def test_one_demo_exchange_against_a_hand_computed_reference():
    # An 8 x 8 weight in four 4 x 4 chunks; lr 1 and decay 0, so the momentum is the gradient. Chunk (0, 0) of group
    # 0's gradient is 3 phi(1,2) + 2 phi(0,3), of group 1's 1 phi(1,2) - 4 phi(3,3); the other chunks are zero. With
    # top_k 2 each group sends exactly its two components, and the decoded mean (at each coefficient, the mean of
    # the groups that sent it) is 2 phi(1,2) + 2 phi(0,3) - 4 phi(3,3).
    size, chunk = 8, 4
    amplitudes = [{(1, 2): 3.0, (0, 3): 2.0}, {(1, 2): 1.0, (3, 3): -4.0}]
    gradients = [torch.zeros(size, size, dtype=torch.float64) for _ in amplitudes]
    for gradient, components in zip(gradients, amplitudes):
        for (i, j), amplitude in components.items():
            gradient[:chunk, :chunk] += amplitude * basis_function(chunk, i, j)
    mean = torch.zeros(size, size, dtype=torch.float64)
    mean[:chunk, :chunk] = 2 * basis_function(chunk, 1, 2) + 2 * basis_function(chunk, 0, 3) \
        - 4 * basis_function(chunk, 3, 3)

    def exchange(index: int, peer_payload: torch.Tensor | None):
        weight = torch.nn.Parameter(torch.zeros(size, size))
        weight.grad = gradients[index].float()
        optimizer = DeMo([weight], lr=1.0, chunk=chunk, top_k=2, decay=0.0)
        collectives = TwoGroups(index, peer_payload)
        optimizer.exchange(collectives)
        optimizer.step()
        return weight.detach(), optimizer.state[weight]["delta"], collectives.sent

    payloads = [exchange(index, None)[2] for index in (0, 1)]
    (weight_0, residual_0, _), (weight_1, residual_1, _) = (exchange(index, payloads[1 - index]) for index in (0, 1))

    # Each coefficient is a 16-term sum of basis x momentum x basis products, contracted in two stages of 4 terms
    # (a rounding of at most 4 EPS relative to each stage's sum of magnitudes, gamma_4), over a basis rounded to fp32
    # (EPS relative) and a momentum rounded to fp32 (EPS): at most (2 * 4 + 3) EPS times the sum of magnitudes,
    # which is at most 16 * max|basis|^2 * max|momentum| (max|basis| = sqrt(2/4), |momentum| <= 5 * 1/2). Decoding is
    # the same arithmetic over coefficients of magnitude <= 4.
    magnitudes = 16 * 0.5 * max(g.abs().max().item() for g in gradients)
    bound = (2 * 4 + 3) * EPS * 16 * 0.5 * 4 + (2 * 4 + 3) * EPS * magnitudes
    sent_positions = payloads[0][:2 * 4 * 2].view(torch.int16).view(4, 2)  # 4 chunks x top 2, int16, first
    assert set(sent_positions[0].tolist()) == {1 * chunk + 2, 0 * chunk + 3}
    for residual in (residual_0, residual_1):  # the sent components left the momentum: nothing is left in chunk 0
        assert residual.abs().max().item() <= 2 * bound
    # Both groups apply the same update, bit for bit: sign(decoded mean), where that is 0 in the zero chunks.
    assert torch.equal(weight_0, weight_1)
    clear = mean.abs() > 2 * bound
    assert clear.sum() >= 12 and torch.equal(weight_0[clear], -torch.sign(mean[clear]).float())
    assert torch.equal(weight_0[chunk:, :], torch.zeros(size - chunk, size))
    assert torch.equal(weight_0[:, chunk:], torch.zeros(size, size - chunk))


class PeerAverage:
    """The collectives of one of two groups, the other's pseudo-gradient ``peer``; the mean as torchft computes it."""

    def __init__(self, peer: torch.Tensor) -> None:
        self.peer = peer

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.add_(self.peer).div_(2)


def test_diloco_is_adamw_inside_and_torch_nesterov_sgd_on_the_mean_pseudo_gradient_outside():
    torch.manual_seed(0)
    weight, reference = (torch.nn.Parameter(torch.randn(6, 5)) for _ in range(2))
    reference.data.copy_(weight.data)
    diloco = DiLoCo([weight], lr=0.1, sync_every=2, outer_lr=0.7, outer_momentum=0.9)
    inner = torch.optim.AdamW([reference], lr=0.1)
    anchor = torch.nn.Parameter(reference.detach().clone())
    outer = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    for step in range(1, 7):
        gradient = torch.randn(6, 5)
        weight.grad, reference.grad = gradient.clone(), gradient.clone()
        peer = torch.randn(6, 5).reshape(-1)
        diloco.exchange(PeerAverage(peer.clone()), step)
        diloco.step()
        inner.step()
        if step % 2 == 0:  # the outer step: torch's Nesterov SGD on the anchor, with the groups' mean as gradient
            anchor.grad = ((anchor.detach() - reference.detach()).reshape(-1) + peer).div(2).view(6, 5)
            outer.step()
            reference.data.copy_(anchor.data)
        assert torch.equal(weight, reference), step


@pytest.mark.parametrize("fmt, qmax, bits", [("int8", 127, 8), ("int4", 7, 4)])
def test_a_quantized_pseudo_gradient_decodes_to_the_same_bits_in_every_group_as_hand_rounding_gives(fmt, qmax, bits):
    # 300 values: one whole block of 256 and one of 44 padded with zeros. Each block travels as its scale
    # absmax / qmax and its codes round(x / scale); each group decodes both groups' blocks, codes x scale, and takes
    # their mean. The reference rounds by hand, with the same fp32 operations, so it is bitwise.
    torch.manual_seed(0)
    flats = [torch.randn(300), torch.randn(300) * 3]

    def decoded(flat: torch.Tensor) -> torch.Tensor:
        blocks = torch.nn.functional.pad(flat, (0, 512 - 300)).view(2, 256)
        scales = blocks.abs().amax(1, keepdim=True) / qmax
        return ((blocks / scales).round() * scales).reshape(-1)[:300]

    def exchange(index: int, peer_payload: torch.Tensor | None):
        collectives = TwoGroups(index, peer_payload)
        return quantized_mean(flats[index].clone(), collectives, fmt), collectives.sent

    payloads = [exchange(index, None)[1] for index in (0, 1)]
    (mean_0, _), (mean_1, _) = (exchange(index, payloads[1 - index]) for index in (0, 1))
    assert torch.equal(mean_0, mean_1)
    assert torch.equal(mean_0, (decoded(flats[0]) + decoded(flats[1])) / 2)
    # what travels: 2 fp32 scales and 512 codes of `bits` bits, as packed_bytes (and inspect's price) count it
    assert payloads[0].numel() == 2 * 4 + 512 * bits // 8 == packed_bytes(300, fmt)
    # Rounding to the nearest code loses at most half a scale s per value, plus the roundings of x / s (EPS relative,
    # |x / s| <= qmax) and of code x s (EPS relative, |code| <= qmax + 1/2): s (1/2 + 2 (qmax + 1) EPS). The largest
    # block's scale bounds every block's.
    for flat in flats:
        scale = flat.abs().max() / qmax
        assert (decoded(flat) - flat).abs().max() <= scale * (0.5 + 2 * (qmax + 1) * EPS)


def test_replica_sync_prices_demo_s_top_components_and_diloco_s_outer_all_reduce():
    step, demo, diloco, diloco_int8 = (inspect_debug("fully_shard", replica_groups=2, replica_sync=sync).fault_tolerant
                                       for sync in (None, dict(sync="demo", chunk=64, top_k=32),
                                                    dict(sync="diloco", sync_every=32),
                                                    dict(sync="diloco", sync_every=8, outer_quantize="int8")))
    # Rank 0 of 8 holds ceil(rows / 8) <= 64 rows of each 2-D weight, all of its 64 or 192 columns: chunks of those
    # rows x 64 columns (the largest divisors <= 64), each sending its top 32 as fp32 values and int16 positions;
    # and 8 of each 1-D norm's 64: one chunk of 8, all sent.
    model = build_model("debug")
    expected = sum(p[0].numel() // 64 * 32 * 6 if p.dim() > 1 else 8 * 6 for p in model.parameters())
    assert demo["exchange_bytes"] == expected and demo["bytes_per_step"] == expected
    assert demo["bytes_per_step"] <= step["bytes_per_step"] / 16
    assert diloco["exchange_bytes"] == step["exchange_bytes"] and diloco["exchange_every"] == 32
    assert diloco["bytes_per_step"] == step["bytes_per_step"] / 32
    assert diloco["step_seconds"] == pytest.approx(step["step_seconds"] - step["exchange_seconds"]
                                                   + diloco["exchange_seconds"] / 32, rel=1e-12)
    # int8: the shard's fp32 values in one row of 256-value blocks, each a byte per value and an fp32 scale,
    # all-gathered (each group sends its own row once) every 8 steps
    values = step["exchange_bytes"] // 4
    assert diloco_int8["exchange_bytes"] == math.ceil(values / 256) * (256 + 4) and diloco_int8["exchange_every"] == 8
    assert diloco_int8["bytes_per_step"] == diloco_int8["exchange_bytes"] / 8


def demo_bytes(shapes: list[tuple[int, ...]], chunk: int = 64, top_k: int = 32) -> int:
    """What DeMo sends per step from tensors of ``shapes``: per chunk of each (as 2-D, sides the largest divisors
    <= ``chunk``), ``top_k`` fp32 values and int16 positions."""
    total = 0
    for shape in shapes:
        rows, columns = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0])
        h, w = largest_divisor(rows, chunk), largest_divisor(columns, chunk)
        total += rows * columns // (h * w) * min(top_k, h * w) * (4 + 2)
    return total


def sent_per_step(mode: str, shapes: list[tuple[int, ...]], steps: int) -> dict[int, int]:
    """The bytes a rank holding tensors of ``shapes`` sends to the other group at each step: DeMo's every step,
    DiLoCo's (H = 4) pseudo-gradient at each outer step (a ring all-reduce of n bytes over 2 groups sends n; int4:
    all shards' values in one row of 256-value blocks, each an fp32 scale and 128 bytes of codes, all-gathered)."""
    if mode == "demo":
        return {step: demo_bytes(shapes) for step in range(1, steps + 1)}
    values = sum(math.prod(shape) for shape in shapes)
    outer = 4 * values if mode == "diloco" else math.ceil(values / 256) * (4 + 128)
    return {step: outer * (step % 4 == 0) for step in range(1, steps + 1)}


def cross_group_bytes(stdout: str) -> dict[tuple[int, int], int]:
    """The bytes each group's rank 0 printed as sent across groups, by (step, group), for steps both groups took."""
    return {(int(step), int(group)): int(count.replace(",", "")) for step, count, group in re.findall(
        r"^step +(\d+)/\d+ .*  cross-group ([\d,]+) B.*  group (\d) replicas 2/2$", stdout, re.M)}


@torchft_wheels
@pytest.mark.parametrize("mode", SYNC)
def test_semi_synchronous_groups_agree_where_the_mode_says_count_their_bytes_and_resume_bitwise(mode, tmp_path):
    """demo: every group applies the same decoded update, so parameters are equal at every step; diloco (H = 4):
    equal after each outer step, apart between. Each group checkpoints its own state and resumes bitwise."""
    from test_fault_tolerance import GROUPS, checksums, steps  # skips its module where torchft has no wheels
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    job = train(*GROUPS, *SYNC[mode], "--steps", "8", "--checkpoint-dir", str(straight), "--checkpoint-every", "4")
    assert job.returncode == 0, job.stderr[-3000:]
    sent = cross_group_bytes(job.stdout)
    assert sorted(sent) == [(step, group) for step in range(1, 9) for group in (0, 1)]
    per_step = sent_per_step(mode, [tuple(p.shape) for p in build_model("debug").parameters()], 8)
    assert sent == {(step, group): per_step[step] for step, group in sent}
    mean = round(sum(per_step.values()) / 8)
    assert re.findall(r"^cross-group bytes per step: (\d+)$", job.stdout, re.M) == [str(mean)] * 2
    outer = re.findall(r"^step +(\d+)/8 .*  outer step, checksum (\w+)  group (\d)", job.stdout, re.M)
    if mode == "diloco":
        assert sorted((int(step), int(group)) for step, _, group in outer) == [(4, 0), (4, 1), (8, 0), (8, 1)]
        assert all(len({value for s, value, _ in outer if s == step}) == 1 for step in ("4", "8"))
    assert len(set(checksums(job.stdout).values())) == 1
    # The groups train on different batches: their losses differ (after step 1, from different parameters in diloco).
    assert [loss for _, loss, *_ in steps(job.stdout, 0)] != [loss for _, loss, *_ in steps(job.stdout, 1)]

    for group in (0, 1):
        shutil.copytree(checkpoint_path(straight / f"group-{group}", 4), checkpoint_path(resumed / f"group-{group}", 4))
    again = train(*GROUPS, *SYNC[mode], "--steps", "8", "--checkpoint-dir", str(resumed), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("resumed from") == 2 and "step    4/8" not in again.stdout
    # a resumed job starts with every group: one joining later would heal, taking the other's state for its own
    assert all(k == 2 and ok for group in (0, 1) for _, _, k, ok in steps(again.stdout, group)), \
        again.stdout + again.stderr[-3000:]  # a restarted group's cause is in stderr
    for group in (0, 1):
        assert_same_checkpoint(checkpoint_path(straight / f"group-{group}", 8),
                               checkpoint_path(resumed / f"group-{group}", 8), tmp_path)


@torchft_wheels
@pytest.mark.parametrize("mode", ["demo", "diloco-int4"])
def test_groups_of_two_ranks_exchange_shard_by_shard_and_agree_where_the_mode_says(mode, tmp_path):
    """2 groups x 2 ranks: FSDP inside a group, and each rank exchanges its own shard with the same rank of the other
    group. Rank 0 sends what its shard (half of every parameter's rows) makes; the groups' whole models are bitwise
    equal after the last step (demo: every step; diloco, H = 4, its pseudo-gradient in int4 blocks: step 8 is an
    outer step; diloco's fp32 exchange is the 2 x 1 tests')."""
    from test_fault_tolerance import GROUPS, steps  # skips its module where torchft has no wheels
    sync = DILOCO_INT4 if mode == "diloco-int4" else SYNC[mode]
    job = train(*GROUPS, "--nproc", "2", *sync, "--steps", "8", "--checkpoint-dir", str(tmp_path))
    assert job.returncode == 0, job.stderr[-3000:]
    assert all(k == 2 and ok for group in (0, 1) for _, _, k, ok in steps(job.stdout, group)), \
        job.stdout + job.stderr[-3000:]  # a restarted group's cause is in stderr
    sent = cross_group_bytes(job.stdout)
    shard_shapes = [(p.shape[0] // 2, *p.shape[1:]) for p in build_model("debug").parameters()]  # all rows even
    per_step = sent_per_step(mode, shard_shapes, 8)
    assert sent == {(step, group): per_step[step] for step in range(1, 9) for group in (0, 1)}
    models = [_load_full(checkpoint_path(tmp_path / f"group-{group}", 8), tmp_path)["model"] for group in (0, 1)]
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][key], models[1][key]) for key in models[0])


@torchft_wheels
@pytest.mark.parametrize("mode", SYNC)
def test_a_group_killed_mid_run_heals_with_the_mode_s_state(mode):
    """The healed group copies the survivor's optimizer state too: diloco's next outer step lands on the same bits
    in both groups only if the healed one got the survivor's anchors and outer momentum (60 is a multiple of 4)."""
    from test_fault_tolerance import assert_a_killed_group_heals

    assert_a_killed_group_heals(*SYNC[mode])


@torchft_wheels
def test_a_kill_during_demo_s_all_gather_commits_that_step_nowhere_and_drops_its_exchange():
    """The all-gather runs on torchft's process group under ``Manager.wrap_future``: a peer dying in it fails the
    step (not a hang), and ``DeMo.discard`` leaves momentum and parameters as they were, so the retry is the same."""
    from test_fault_tolerance import assert_a_kill_mid_exchange_commits_that_step_nowhere

    assert_a_kill_mid_exchange_commits_that_step_nowhere("cross-replica-gather", *SYNC["demo"])
