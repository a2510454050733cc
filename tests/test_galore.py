"""``GaLoreAdamW`` on 2 gloo ranks against a one-process GaLore on the unsharded weights, across a refresh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from scenarios import U, gamma
from test_train_cli import assert_same_checkpoint, expected_state_bytes, train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from simplefsdp.models.llama import get_config
from simplefsdp.optim import GaLoreAdamW, top_right_singular_vectors
from simplefsdp.optim.galore import refresh_seed
from simplefsdp.runtime.checkpoint import checkpoint_path

RANK, UPDATE_EVERY, STEPS = 4, 2, 3  # refreshes at steps 1 and 3
# Adam's eps is large against sqrt(v) (gradients about 1e-2): the division is Lipschitz (1/eps), so rounding
# differences in the projected gradient have a bound; the projection, sharding and refresh are the same for any eps.
HYPER = dict(lr=0.1, rank=RANK, update_every=UPDATE_EVERY, scale=0.5, betas=(0.9, 0.99), eps=1.0,
             weight_decay=0.01, seed=3)
# tall, wide with rows uneven over 2 ranks, a matrix no larger than the rank (AdamW), a vector (AdamW)
SHAPES = {"tall": (40, 24), "wide": (21, 36), "small": (4, 9), "vector": (10,)}


def gradients(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {name: 1e-2 * torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def initial_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def reference_galore(projector_dtype: torch.dtype = torch.float32
                     ) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """GaLore 2's update on whole tensors, one process, with projectors stored in ``projector_dtype``: the final
    weights, each projected weight's projectors and the elementwise bound on how far a sharded run's final weights
    may round apart from these."""
    weights, moments, projectors, bounds = initial_weights(), {}, {}, {}
    beta1, beta2, eps, lr = *HYPER["betas"], HYPER["eps"], HYPER["lr"]
    history: dict[str, list] = {}
    for step in range(1, STEPS + 1):
        for index, (name, grad) in enumerate(gradients(step).items(), start=1):
            projected = grad.ndim == 2 and min(grad.shape) > RANK
            if projected and (step - 1) % UPDATE_EVERY == 0:
                projectors.setdefault(name, []).append(top_right_singular_vectors(
                    grad, RANK, seed=refresh_seed(HYPER["seed"], step, index)).to(projector_dtype))
            q = projectors[name][-1].float() if projected else None
            r = grad @ q if projected else grad
            m, v = moments.get(name, (torch.zeros_like(r), torch.zeros_like(r)))
            m, v = m.lerp(r, 1 - beta1), v.mul(beta2).addcmul(r, r, value=1 - beta2)
            moments[name] = (m, v)
            n = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
            update = HYPER["scale"] * (n @ q.T) if projected else n
            weights[name] = weights[name].mul(1 - lr * HYPER["weight_decay"]).add(update, alpha=-lr)
            history.setdefault(name, []).append((grad, q, r, m / (1 - beta1**step), n))
    for name, steps in history.items():
        bounds[name] = rounding_bound(steps, weights[name], lr)
    return weights, projectors, bounds


def rounding_bound(steps: list, final: torch.Tensor, lr: float) -> torch.Tensor:
    """Elementwise bound on a sharded run's final weight against the reference's, from the arithmetic.

    The refresh is bitwise (same gradient bytes, same sketch). What may differ: the two products ``R = G Q`` and
    ``N Q^T``, whose rows a rank computes in a matrix of fewer rows (each side is within ``gamma(k) |A| |B|`` of the
    exact product, so they differ by twice that); and an elementwise kernel's vector body and scalar tail, which fall
    on other elements in a shorter shard and may fuse a multiply-add differently (one rounding, ``2u`` relative, in
    each of ``N``'s ten operations and in the weight's two). Adam's bias-corrected moments are convex combinations of
    the ``R``s and ``R^2``s seen, so they differ by at most the largest of those differences;
    ``N = m / (sqrt(v) + eps)`` moves by ``|dm| / eps + |m| |d sqrt(v)| / eps^2`` with ``|d sqrt(v)| <= sqrt(|dv|)``.
    Each step's weight moves by ``lr`` times its update's difference.
    """
    eps, scale = HYPER["eps"], HYPER["scale"]
    d_r_max = d_v_max = torch.zeros_like(steps[0][2])
    total = torch.zeros_like(final)
    for grad, q, r, m_hat, n in steps:
        d_r = 2 * gamma(grad.shape[-1]) * (grad.abs() @ q.abs()) if q is not None else torch.zeros_like(r)
        d_r_max = torch.maximum(d_r_max, d_r)
        d_v_max = torch.maximum(d_v_max, 2 * r.abs() * d_r + d_r * d_r)
        d_n = d_r_max / eps + (m_hat.abs() + d_r_max) * d_v_max.sqrt() / eps**2 + 10 * 2 * U * n.abs()
        d_update = scale * (d_n @ q.abs().T + 2 * gamma(RANK) * (n.abs() @ q.abs().T)) if q is not None else d_n
        total += lr * d_update
    return total + 2 * 2 * U * len(steps) * final.abs().max()


def _sharded_galore(shard_projector: bool, projector_dtype: torch.dtype | None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """The same steps with each weight a Shard(0) DTensor over 2 ranks; returns full weights and the projectors."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parameters = {name: torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None))
                  for name, weight in initial_weights().items()}
    optimizer = GaLoreAdamW(parameters.values(), **HYPER, projector_dtype=projector_dtype,
                            shard_projector=shard_projector)
    projectors: dict[str, list[torch.Tensor]] = {}
    for step in range(1, STEPS + 1):
        for name, grad in gradients(step).items():
            parameters[name].grad = distribute_tensor(grad, mesh, [Shard(0)], src_data_rank=None)
        optimizer.step()
        for name, parameter in parameters.items():
            if "projector" in optimizer.state[parameter] and (step - 1) % UPDATE_EVERY == 0:
                projector = optimizer.state[parameter]["projector"]
                assert isinstance(projector, DTensor) == shard_projector
                projectors.setdefault(name, []).append(
                    projector.full_tensor() if shard_projector else projector.clone())
    assert all(isinstance(optimizer.state[p]["exp_avg"], DTensor) for p in parameters.values())
    return {name: p.full_tensor() for name, p in parameters.items()}, projectors


# (shard_projector, projector_dtype): the default layout, the sharded projector, and bf16 projectors replicated
LAYOUTS = [(False, None), (True, None), (False, torch.bfloat16)]


def _every_layout() -> list:
    return [_sharded_galore(*layout) for layout in LAYOUTS]


def test_the_subspace_of_a_rank_r_gradient_is_found():
    """An exactly rank-4 gradient (singular values 10 .. 1): the sketch spans its row space, so the projector's
    span is the true one up to QR's and SVD's rounding, amplified by the condition number 10: well under 1e-4."""
    generator = torch.Generator().manual_seed(0)
    left = torch.linalg.qr(torch.randn(30, 4, generator=generator)).Q
    right = torch.linalg.qr(torch.randn(20, 4, generator=generator)).Q
    grad = left @ torch.diag(torch.tensor([10.0, 5.0, 2.0, 1.0])) @ right.T
    q = top_right_singular_vectors(grad, 4, seed=1)
    assert torch.linalg.matrix_norm(q @ q.T - right @ right.T, ord=2) < 1e-4
    assert torch.equal(q, top_right_singular_vectors(grad, 4, seed=1))


def test_two_ranks_match_one_process_across_a_refresh():
    for rank in run_on_ranks(2, _every_layout):
        for (_, projector_dtype), (rank_weights, rank_projectors) in zip(LAYOUTS, rank, strict=True):
            _assert_matches_the_reference(projector_dtype or torch.float32, rank_weights, rank_projectors)


def _assert_matches_the_reference(projector_dtype: torch.dtype, rank_weights: dict, rank_projectors: dict) -> None:
    expected, expected_projectors, bounds = reference_galore(projector_dtype)
    for name, projectors in expected_projectors.items():  # bitwise: same bytes into the same function
        assert len(rank_projectors[name]) == 2
        assert all(torch.equal(a, b) for a, b in zip(rank_projectors[name], projectors)), name
    for name, bound in bounds.items():
        difference = (rank_weights[name] - expected[name]).abs()
        assert (difference <= bound).all(), f"{name}: {(difference - bound).max().item()} over the bound"
    assert set(bounds) == set(SHAPES)
    assert not torch.equal(rank_weights["tall"], initial_weights()["tall"])


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank >= 1"):
        GaLoreAdamW([torch.nn.Parameter(torch.zeros(4, 4))], rank=0)


def test_train_with_galore_resumes_exactly_across_a_refresh_and_reports_its_state(tmp_path):
    """``train --optimizer galore`` (accumulation and clipping on, bf16 projectors) saved at step 2 and resumed
    trains step 3 with the projectors of step 1 and step 4 across a refresh, to the same bytes as a straight run, and
    prints its state size (AdamW's: test_train_cli) and, without --lr, GaLore's recommended rate it trains at."""
    galore = ["--optimizer", "galore", "--galore-update-every", "3", "--galore-projector-dtype", "bfloat16"]
    killed, straight = tmp_path / "resumed", tmp_path / "straight"
    assert train(*galore, "--steps", "2", "--checkpoint-dir", str(killed)).returncode == 0
    resumed = train(*galore, "--steps", "4", "--checkpoint-dir", str(killed), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    whole = train(*galore, "--steps", "4", "--checkpoint-dir", str(straight))
    assert whole.returncode == 0, whole.stderr
    rank = get_config("debug").dim // 4
    state_bytes = expected_state_bytes("galore", rank, projector_bytes=2)
    assert f"optimizer state bytes per rank: {state_bytes}\n" in whole.stdout
    assert "--optimizer galore: lr 0.01, GaLore's recommended rate (pass --lr to change it)\n" in whole.stdout
    assert_same_checkpoint(checkpoint_path(straight, 4), checkpoint_path(killed, 4), tmp_path)
    assert expected_state_bytes("galore", rank, projector_bytes=2) < expected_state_bytes("galore", rank) \
        < 0.6 * expected_state_bytes("adamw", rank)


@pytest.mark.parametrize("options, message", [
    (["--tp", "2", "--nproc", "4"], "--tp shards"),
    (["--galore-rank", "0"], "must be at least 1"),
    (["--fault-tolerant", "--nproc", "1"], "does not combine with --fault-tolerant"),
])
def test_galore_refuses_what_it_cannot_combine_before_any_rank_starts(options, message):
    job = train("--optimizer", "galore", *options, timeout=60)
    assert job.returncode != 0 and message in job.stderr and "step " not in job.stdout
