"""Models, data, training loops and fp32 error bounds shared by the multi-rank numerics tests.

Each scenario is a model factory, a global batch per step and a loss. A rank
trains its slice of every global batch; the reference trains the whole global
batch in one process with no sharding at all.

Against the reference the optimizer is plain SGD: the parameter update is then
linear in the gradients, so a bound on the gradients' rounding differences bounds
the updates'. AdamW divides each gradient element by its own running magnitude:
a rounding difference on a near-zero element becomes an O(lr) parameter
difference, and no fp32 bound exists for that. AdamW stays where the check is
bitwise (against FSDP2), so the optimizer on DTensors stays covered.
"""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from simplefsdp.models.llama import build_model

STEPS = 5
LOCAL_BATCH = 2
SGD_LR = 0.1  # large enough that updates are not lost in the parameters' rounding, small enough to be stable
ADAMW_LR = 1e-3

# fp32 error bound for one forward+backward of the debug model computed twice with reductions in another
# order (a batch split over ranks, Inductor's fused kernels, another CPU's vector width):
# - a sum of K terms reordered differs by at most gamma_K = K*u/(1-K*u) times the sum of the terms'
#   magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1), u = 2^-24.
#   We compare norm-wise: for sums of terms of random sign the sum of magnitudes is about sqrt(K) times
#   the sum, and reordered rounding errors grow like sqrt(K)*u (Higham and Mary, 2019), so gamma_K
#   relative to the result is the right size.
# - the longest reduction is the 256-word vocabulary (cross-entropy's sum, the output layer's input
#   gradient); the others are 64 (dim, tokens per step at 2 ranks), 128 (tokens at 4 ranks), 192 (SwiGLU).
# - errors add along the longest dependent chain of reductions, each op of condition about 1: forward per
#   block 9 (2 RMSNorm means, q, scores, softmax sum, probs@v, wo, w1, w2), 2 blocks plus final norm,
#   output, the loss's two sums: 22; backward mirrors each: 22; the gradient's reduction over ranks: 1.
#   Counted up to 48.
# - an elementwise op is not reordered, but another kernel (vectorized vs scalar exp/rsqrt/sigmoid, FMA or
#   not) may round it otherwise: at most 2u for each of the ~160 elementwise ops on that chain.
U = 2.0**-24
LONGEST_REDUCTION = 256
DEPENDENT_REDUCTIONS = 48
ELEMENTWISE_OPS = 160


def gamma(terms: int) -> float:
    """Higham's gamma_K: the relative error bound of a K-term fp32 sum in any order."""
    return terms * U / (1 - terms * U)


FORWARD_BACKWARD_BOUND = DEPENDENT_REDUCTIONS * gamma(LONGEST_REDUCTION) + ELEMENTWISE_OPS * 2 * U


def update_bound(initial: torch.Tensor, update: torch.Tensor) -> float:
    """Bound on the norm-wise relative difference of two SGD runs' ``update = p_final - p_init``.

    The gradients' differences pass linearly into the update (FORWARD_BACKWARD_BOUND; after the first step
    the parameters differ too, by lr times that, which moves the next gradient by far less). Each step also
    rounds ``p - lr * g`` to the parameter's own ulp: two runs whose gradients differ may round apart by
    2u|p| per step, which norm-wise is 2 * STEPS * u * |p_init| / |update|.
    """
    return FORWARD_BACKWARD_BOUND + 2 * STEPS * U * initial.norm().item() / update.norm().clamp_min(1e-30).item()


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative difference ``|actual - expected| / |expected|``."""
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()


def assert_matches_reference(scenario: str, world: int, losses: list[float], rank_params: list[dict]) -> float:
    """Assert that the global mean loss of each step and every rank's parameter updates (``p_final - p_init``: the
    parameters' own size would hide errors) are within fp32 rounding of one process training the global batch of
    ``world`` data-parallel ranks; return the largest update difference as a fraction of its bound."""
    ref_losses, ref_params = train_reference(scenario, world)
    initial = dict(build(scenario).named_parameters())
    assert len(losses) == len(ref_losses)
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        # a loss is a forward (part of the forward+backward bound) on parameters that differ by an lr-sized
        # multiple of it, which moves the loss by far less
        assert abs(loss - ref) <= FORWARD_BACKWARD_BOUND * abs(ref), f"step {step}: loss {loss} vs reference {ref}"
    worst = 0.0
    for params in rank_params:
        assert params.keys() == ref_params.keys()
        for name, ref in ref_params.items():
            start = initial[name].detach()
            ref_update, update = ref - start, params[name] - start
            if not initial[name].requires_grad:
                assert torch.equal(update, ref_update), f"frozen {name} changed"
                continue
            difference, bound = relative_difference(update, ref_update), update_bound(start, ref_update)
            assert difference <= bound, f"{name}: update differs by {difference:.2e} (bound {bound:.2e})"
            worst = max(worst, difference / bound)
    return worst


class TwoLinears(nn.Module):
    """Two linear layers as a user writes them: a module class of the user's own."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


class WithTinyFirstDim(nn.Module):
    """A parameter whose first dimension (1) is smaller than the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(1, 8))
        self.proj = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * self.scale)


class WithFrozenLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(x)))


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 3)
        self.register_buffer("offset", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x - self.offset)


class WithGraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(hidden)


class BreakingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)
        torch._dynamo.graph_break()
        return torch.tanh(hidden)


class WithGraphBreakInEachBlock(nn.Module):
    """Nine blocks whose forwards each break Dynamo's graph: Dynamo compiles the blocks' frames on their own, and
    there are more blocks than its recompile limit (8) allows graphs per frame. Within ``FORWARD_BACKWARD_BOUND``'s
    counts: 10 linear layers and the loss's 2 sums on the chain, 12 reductions forward and 12 backward (48 counted),
    none longer than 8 terms (256 counted), and 9 tanh (160 elementwise ops counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BreakingBlock() for _ in range(9))
        self.output = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


class RoutedExperts(nn.Module):
    """Each sample sent to one of 3 experts by its router's argmax and grouped by expert in sizes read with
    ``.tolist()``, as JetMoE's layers do: a rank's sizes depend on its data (with 2 samples a rank, some expert gets
    none). Within ``FORWARD_BACKWARD_BOUND``'s counts: 4 matmuls of at most 8 terms and the loss's sums on the chain,
    6 reductions forward and as many backward, a softmax. The argmax could route a sample otherwise only where two
    logits tie to fp32 rounding (a relative gap under 1e-6: about 1e-5 for these 20 routings)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 3)
        self.experts = nn.Parameter(torch.randn(3, 8, 8) / 8**0.5)
        self.output = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        choice = logits.argmax(-1)
        order = choice.argsort(stable=True)
        sizes = (choice[:, None] == torch.arange(3, device=x.device)).sum(0).tolist()
        grouped = torch.cat([part @ expert for part, expert in zip(x[order].split(sizes), self.experts)])
        gate = torch.softmax(logits, -1).amax(-1, keepdim=True)
        return self.output(x + gate * grouped[order.argsort()])


def _token_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (size, 17), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _feature_batch(in_features: int, out_features: int):
    def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(100 + step)
        return torch.randn(size, in_features, generator=generator), torch.randn(size, out_features, generator=generator)

    return batch


def _lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())


def _mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


SCENARIOS = {
    "llama": (lambda: build_model("debug"), _token_batch, _lm_loss),
    "tied_llama": (lambda: build_model("debug", tie_embeddings=True), _token_batch, _lm_loss),
    "one_layer_llama": (lambda: build_model("debug", n_layers=1), _token_batch, _lm_loss),
    # an embedding of 1024 rows, which 2 ranks look up where it is sharded at up to 128 tokens each
    "one_layer_llama_1k_vocab": (lambda: build_model("debug", n_layers=1, vocab_size=1024), _token_batch, _lm_loss),
    "linear_7x5": (lambda: nn.Linear(7, 5), _feature_batch(7, 5), _mse_loss),
    "tiny_first_dim": (WithTinyFirstDim, _feature_batch(8, 3), _mse_loss),
    "frozen_layer": (WithFrozenLayer, _feature_batch(8, 3), _mse_loss),
    "buffer": (WithBuffer, _feature_batch(8, 3), _mse_loss),
    "graph_break": (WithGraphBreak, _feature_batch(8, 3), _mse_loss),
    "graph_break_in_each_block": (WithGraphBreakInEachBlock, _feature_batch(8, 3), _mse_loss),
    "routed_experts": (RoutedExperts, _feature_batch(8, 3), _mse_loss),
}


def build(scenario: str) -> nn.Module:
    """The scenario's model, initialized from seed 0."""
    torch.manual_seed(0)
    return SCENARIOS[scenario][0]()


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=SGD_LR) if name == "sgd" else torch.optim.AdamW(params, lr=ADAMW_LR)


def train_reference(scenario: str, world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, no sharding: SGD on the concatenated global batch of ``world_size`` ranks."""
    model = build(scenario)
    _, batch, loss_fn = SCENARIOS[scenario]
    optimizer = make_optimizer(model, "sgd")
    losses = []
    for step in range(STEPS):
        inputs, target = batch(step, LOCAL_BATCH * world_size)
        loss = loss_fn(model(inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: param.detach().clone() for name, param in model.named_parameters()}


def _wrap_fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(model, "layers", []):
        fully_shard(layer)
    return fully_shard(model)


def train_on_rank(scenario: str, wrapper: str, options: dict) -> dict:
    """Train this rank's slice with ``wrapper`` ("simplefsdp" or "fsdp2"); return losses, params, checks.

    ``options["optimizer"]`` is "sgd" (the default) or "adamw"; the rest go to ``compile_sharded``.
    """
    from simplefsdp import MixedPrecision, compile_sharded

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(scenario)
    if scenario == "buffer" and rank != 0:
        model.offset.add_(1.0)  # must be overwritten by rank 0's value when wrapping
    options = dict(options)
    mesh_shape = options.pop("mesh_shape", None)
    param_dtype = options.pop("param_dtype", None)
    optimizer_name = options.pop("optimizer", "sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if wrapper == "fsdp2":
            model = _wrap_fsdp2(model)
        else:
            if mesh_shape is not None:
                from torch.distributed.device_mesh import init_device_mesh

                options["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
            policy = MixedPrecision(param_dtype, torch.float32) if param_dtype else None
            returned = compile_sharded(model, mp_policy=policy, **options)
            assert returned is model
        _, batch, loss_fn = SCENARIOS[scenario]
        optimizer = make_optimizer(model, optimizer_name)
        losses, grad_placements, grad_digests = [], {}, []
        for step in range(STEPS):
            inputs, target = batch(step, LOCAL_BATCH * world)
            loss = loss_fn(model(inputs.chunk(world)[rank]), target.chunk(world)[rank])
            loss.backward()
            grad_placements = {
                name: None if p.grad is None else (type(p.grad).__name__, tuple(map(str, p.grad.placements)))
                for name, p in model.named_parameters()
            }
            grad_digests.append(_digest(p.grad.to_local() for p in model.parameters() if p.grad is not None))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return {
        "losses": losses,
        "params": {name: p.full_tensor() for name, p in model.named_parameters()},
        "param_placements": {name: tuple(map(str, p.placements)) for name, p in model.named_parameters()},
        "param_is_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "grad_placements": grad_placements,
        "grad_digests": grad_digests,
        "state_dict_keys": list(model.state_dict()),
        "buffers": {name: b.clone() for name, b in model.named_buffers()},
        "tied": scenario != "tied_llama"
        or model.output._parameters["weight"] is model.tok_embeddings._parameters["weight"],
        "warnings": [str(w.message) for w in caught if "graph-breaks" in str(w.message)],
    }


def _digest(tensors) -> str:
    """A hash of the tensors' bytes: equal digests mean bitwise-equal tensors."""
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(tensor.detach().flatten().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def run_jobs(jobs: list[tuple[str, str, dict]]) -> list[dict]:
    """Run each ``(scenario, wrapper, options)`` job in turn on this rank."""
    return [train_on_rank(*job) for job in jobs]
