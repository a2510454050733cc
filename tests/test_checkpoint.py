"""DCP checkpoints: exact resume, loading at other world sizes, no parameter all-gather, clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from collectives import CountCollectives
from ranks import run_on_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from simplefsdp import compile_sharded
from simplefsdp.models.llama import build_model
from simplefsdp.runtime.checkpoint import check_compatible, latest_checkpoint, load_checkpoint, save_checkpoint

STEPS, SAVE_AT = 4, 2


def _setup(**overrides):
    """A sharded debug model (eager: checkpointing is not about Inductor) and its AdamW."""
    torch.manual_seed(0)
    model = compile_sharded(build_model("debug", **overrides), compile=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optimizer, first_step, last_step):
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(first_step, last_step + 1):
        data = torch.randint(0, 256, (world * 2, 17), generator=torch.Generator().manual_seed(step))
        tokens = data.chunk(world)[rank]
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full_state(model, optimizer):
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    moments = {f"{name}.{key}": value.full_tensor() if hasattr(value, "full_tensor") else value
               for name, p in model.named_parameters() for key, value in optimizer.state[p].items()}
    return params, moments


def _straight_and_saved(root):
    """Train STEPS straight; separately train SAVE_AT steps and save, counting collectives of the save."""
    straight, straight_optimizer = _setup()
    _train(straight, straight_optimizer, 1, STEPS)
    model, optimizer = _setup()
    _train(model, optimizer, 1, SAVE_AT)
    with CountCollectives() as counter:
        save_checkpoint(root, SAVE_AT, model, optimizer)
    return _full_state(straight, straight_optimizer), _full_state(model, optimizer)[0], dict(counter.counts)


def _resume(root, steps):
    model, optimizer = _setup()
    with CountCollectives() as counter:
        step = load_checkpoint(latest_checkpoint(root), model, optimizer)
    _train(model, optimizer, step + 1, steps)
    return step, _full_state(model, optimizer), dict(counter.counts)


def test_resume_is_exact_and_loads_at_other_world_sizes(tmp_path):
    straight, saved_params, save_counts = run_on_ranks(2, _straight_and_saved, tmp_path)[0]
    assert save_counts == {}, "saving gathered parameters"
    step, resumed, load_counts = run_on_ranks(2, _resume, tmp_path, STEPS)[0]
    assert step == SAVE_AT and load_counts == {}
    for expected, actual in zip(straight, resumed):
        assert expected.keys() == actual.keys()
        for name in expected:
            assert torch.equal(expected[name], actual[name]), name
    for world_size in (1, 4):
        for _, (params, _), _ in run_on_ranks(world_size, _resume, tmp_path, SAVE_AT):
            for name, value in saved_params.items():
                assert torch.equal(params[name], value), (world_size, name)


def _pretrained_loaded_after_wrapping() -> dict[str, object]:
    """Into models wrapped from seed 0, a full state dict of plain tensors (seed 1, every rank holding all of it) by
    ``model.load_state_dict``, in each layout of 4 ranks, and by DCP's ``set_model_state_dict``: per way, whether
    every parameter holds the pretrained values after, and the collectives the load ran; the size-mismatch error."""
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp.models.llama_tp import parallelize_llama

    def load(way: str, tied: bool = False, **options) -> tuple[bool, dict]:
        torch.manual_seed(1)
        pretrained = build_model("debug", tie_embeddings=tied).state_dict()
        torch.manual_seed(0)
        model = build_model("debug", tie_embeddings=tied)
        if way == "fsdp_x_tp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            parallelize_llama(model, mesh["tp"])
            options["mesh"] = mesh["dp"]
        compile_sharded(model, compile=False, **options)
        with CountCollectives() as counter:
            if way == "dcp":
                set_model_state_dict(model, dict(pretrained), options=StateDictOptions(full_state_dict=True))
            else:
                model.load_state_dict(pretrained)
        loaded = all(torch.equal(p.full_tensor(), pretrained[name]) for name, p in model.named_parameters())
        return loaded and (not tied or model.output._parameters["weight"] is model.tok_embeddings._parameters[
            "weight"]), dict(counter.counts)

    hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    results = {"fully_shard": load("fully_shard"), "tied": load("tied", tied=True),
               "replicate": load("replicate", mode="replicate"),
               "hybrid_shard": load("hybrid_shard", mode="hybrid_shard", mesh=hybrid),
               "fsdp_x_tp": load("fsdp_x_tp"), "dcp": load("dcp")}
    model = compile_sharded(build_model("debug"), compile=False)
    try:
        model.load_state_dict(build_model("debug", dim=96).state_dict())
    except RuntimeError as error:
        results["mismatch"] = str(error)
    torch.manual_seed(2)
    block = build_model("debug").layers[1].state_dict()
    before = [torch.equal(p.full_tensor(), block[name]) for name, p in model.layers[1].named_parameters()]
    model.layers[1].load_state_dict(block)
    results["one block"] = not all(before) and all(  # norms start at ones either way
        torch.equal(p.full_tensor(), block[name]) for name, p in model.layers[1].named_parameters()), {}
    return results


def test_a_full_state_dict_loads_after_wrapping_into_every_layout_without_collectives():
    """``model.load_state_dict`` of plain full tensors cuts each rank's shard locally (fully_shard, tied, replicate,
    hybrid_shard, FSDP x TP's strided shards, one block's own ``load_state_dict``), as DCP's ``set_model_state_dict``
    does; another shape still gets ``load_state_dict``'s own size-mismatch error."""
    for results in run_on_ranks(4, _pretrained_loaded_after_wrapping):
        mismatch = results.pop("mismatch")
        assert "size mismatch for tok_embeddings.weight" in mismatch and "[256, 96]" in mismatch, mismatch
        for way, (loaded, collectives) in results.items():
            assert loaded, way
            if way != "dcp":  # DCP's full-state-dict load runs its own collectives
                assert collectives == {}, (way, collectives)


def test_loading_a_different_model_names_the_parameter(tmp_path):
    dcp.save({"model": build_model("debug").state_dict(), "step": 1}, checkpoint_id=tmp_path)  # one process
    with pytest.raises(ValueError, match="'tok_embeddings.weight' with shape \\(256, 64\\).*\\(256, 96\\)"):
        check_compatible(tmp_path, build_model("debug", dim=96).state_dict())
    with pytest.raises(ValueError, match="has no parameter 'layers.2.attention_norm.weight'"):
        check_compatible(tmp_path, build_model("debug", n_layers=3).state_dict())


def test_latest_checkpoint_skips_partial_saves(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / ".metadata").write_bytes(b"")
    (tmp_path / ".step-00000005.partial").mkdir()
    (tmp_path / "step-00000004").mkdir()  # no .metadata: incomplete
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000003"
