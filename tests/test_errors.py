"""Bad input gets a clear error that names the fix, raised before any collective runs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp.runtime.sharding as sharding
from simplefsdp import MixedPrecision, compile_sharded, materialize_sharded
from simplefsdp.runtime.compile import compiled_graphs
from ranks import run_on_ranks


@pytest.fixture
def no_collectives(monkeypatch):
    """Make every collective compile_sharded could issue fail loudly."""
    for name in ("all_gather_object", "broadcast", "all_gather", "scatter"):
        monkeypatch.setattr(dist, name, _collective_issued)
    monkeypatch.setattr(sharding, "distribute_tensor", _collective_issued)


def _collective_issued(*args, **kwargs):
    raise AssertionError("a collective was issued before the input was rejected")


def test_not_a_module(fake_world, no_collectives):
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got function"):
        compile_sharded(lambda x: x)


def test_applied_twice(fake_world):
    model = compile_sharded(nn.Linear(4, 4), compile=False)
    with pytest.raises(ValueError, match="already a DTensor: compile_sharded was applied .* apply it once"):
        compile_sharded(model, compile=False)


@pytest.mark.parametrize(
    ("mode", "shape", "message"),
    [
        ("fully_shard", (2, 4), "needs a 1-D mesh but got a 2-D mesh of shape \\(2, 4\\)"),
        ("replicate", (2, 4), "needs a 1-D mesh"),
        ("hybrid_shard", (8,), "needs a 2-D mesh .* init_device_mesh\\(device, \\(replicas, shards\\)\\)"),
    ],
)
def test_mesh_does_not_fit_mode(fake_world, no_collectives, mode, shape, message):
    mesh = init_device_mesh("cpu", shape)
    with pytest.raises(ValueError, match=message):
        compile_sharded(nn.Linear(4, 4), mesh=mesh, mode=mode, compile=False)


def test_unknown_mode(fake_world, no_collectives):
    with pytest.raises(ValueError, match="unknown mode 'zero3'; choose one of: fully_shard, replicate, hybrid_shard"):
        compile_sharded(nn.Linear(4, 4), mode="zero3")


def test_decorator_form_checks_options_at_once():
    with pytest.raises(ValueError, match="unknown mode 'zero3'"):
        compile_sharded(mode="zero3")


def test_non_floating_param_dtype(fake_world, no_collectives):
    with pytest.raises(ValueError, match="must be a floating-point torch.dtype, e.g. param_dtype=torch.bfloat16"):
        compile_sharded(nn.Linear(4, 4), mp_policy=MixedPrecision(param_dtype=torch.int32))


def test_unknown_compile_option(fake_world, no_collectives):
    with pytest.raises(TypeError, match="unknown option\\(s\\) fulgraph; .* fullgraph"):
        compile_sharded(nn.Linear(4, 4), fulgraph=True)


def test_an_optimizer_made_before_compile_sharded_is_refused_at_its_first_step(fake_world):
    """compile_sharded replaces each parameter by a sharded DTensor parameter: an optimizer made before it would step
    tensors that no gradient reaches, and the model would never train, silently (as with FSDP2's fully_shard)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    early = torch.optim.SGD(model.parameters(), lr=0.5)
    compile_sharded(model, compile=False)
    with pytest.raises(ValueError, match="SGD holds parameter '0.weight' as it was before compile_sharded, which "
                                         "replaced it .* create the optimizer after compile_sharded"):
        early.step()
    late = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.to_local().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    late.step()
    # SGD's p + (-0.5) * 1 has an exact product, so it rounds once, as p - 0.5 does: bitwise
    assert all(torch.equal(p.to_local(), old - 0.5) for p, old in zip(model.parameters(), before))


def test_a_plain_parameter_beside_sharded_ones_is_refused_at_the_first_step(fake_world):
    """compile_sharded applied to a block but not to the root (an FSDP2 habit without its last line) leaves the
    embedding plain: no rank averages its gradient, and the ranks would drift apart, silently."""
    model = nn.Sequential(nn.Embedding(10, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    compile_sharded(model[1], compile=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.tensor([[1, 2]])).sum().backward()
    with pytest.raises(ValueError, match=r"SGD holds a plain parameter of shape \(10, 8\) beside parameters sharded "
                                         "by compile_sharded.* apply compile_sharded once, to the outermost module"):
        optimizer.step()
    model[0].weight.requires_grad_(False)  # frozen, it needs no averaging
    optimizer.step()


def _error_of_compile_sharded(rank_dependent: str) -> str:
    """This rank's error from ``compile_sharded`` when rank 1 differs from rank 0 in the model (``"model"``: a wider
    layer) or in an argument (``"buckets"``: with Inductor, rank 0 would wait in the profile's broadcast and plan
    other collectives; the check compares the arguments before any of that)."""
    other = dist.get_rank() == 1
    try:
        if rank_dependent == "model":
            compile_sharded(nn.Linear(8, 4 if other else 3), compile=False)
        else:
            compile_sharded(nn.Linear(8, 3), buckets="block" if other else "auto")
    except ValueError as error:
        return str(error)
    return "no error"


def test_shapes_differ_across_ranks():
    messages = run_on_ranks(2, _error_of_compile_sharded, "model")
    assert messages[0] == messages[1] == (
        "the model differs between rank 1 and rank 0: parameter weight (4, 8) torch.float32 on rank 1, "
        "parameter weight (3, 8) torch.float32 on rank 0; build the same model (same config) on every rank before "
        "compile_sharded")


def test_arguments_differ_across_ranks():
    messages = run_on_ranks(2, _error_of_compile_sharded, "buckets")
    assert messages[0] == messages[1] == (
        "compile_sharded's arguments differ between rank 1 and rank 0: argument buckets='block' on rank 1, argument "
        "buckets='auto' on rank 0; pass the same arguments on every rank (they decide which collectives every rank "
        "issues)")


def _train_on_three_batch_sizes_with_rank_0_allowed_one_graph() -> None:
    if dist.get_rank() == 0:
        torch._dynamo.config.recompile_limit = 1
    model = compile_sharded(nn.Linear(8, 3), backend="aot_eager", dynamic=False)
    for batch in (4, 2, 3):
        model(torch.randn(batch, 8)).sum().backward()


def test_a_rank_past_dynamos_recompile_limit_stops_instead_of_running_eagerly():
    """Past the limit Dynamo runs a frame eagerly; that rank's collectives would not match the others' graphs."""
    with pytest.raises(RuntimeError, match=r"(?s)rank 0: .*Dynamo hit its recompile limit \(torch._dynamo.config."
                                           r"recompile_limit = 1\) on this rank.*TORCH_LOGS=recompiles"):
        run_on_ranks(2, _train_on_three_batch_sizes_with_rank_0_allowed_one_graph)


def _train_wav2vec2_on_two_graphs_a_frame() -> None:
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    torch._dynamo.config.recompile_limit = 2
    torch.manual_seed(0)
    model = Wav2Vec2ForSequenceClassification(Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        num_labels=3))
    compile_sharded(model, backend="aot_eager")
    model(torch.randn(2, 400)).logits.sum().backward()


def test_a_model_past_the_recompile_limit_between_graph_breaks_is_told_the_break_and_its_fix():
    """Hugging Face's wav2vec2 breaks Dynamo's graph (its feature encoder marks its input as requiring grad); Dynamo
    then compiles the code between breaks frame by frame, the frame that reads a parameter once per parameter name,
    past the limit (2 here; 8 by default, which 12 layers stay within: ``test_zoo``): the error names the breaks, and
    its last line the model's fix."""
    with pytest.raises(RuntimeError, match=r"(?s)rank 0: .*compiling Wav2Vec2ForSequenceClassification between its "
                                           r"graph breaks \(.*setattr\(\) on Tensor.requires_grad.*Fix: set "
                                           r"model.wav2vec2.feature_extractor._requires_grad = False"):
        run_on_ranks(2, _train_wav2vec2_on_two_graphs_a_frame)


def test_unknown_bucket_mode(no_collectives):
    with pytest.raises(ValueError, match="unknown bucket mode 'per-layer'; choose 'auto', 'block', None, or a manual"):
        compile_sharded(nn.Linear(4, 4), buckets="per-layer")


def test_manual_plan_names_a_missing_module(no_collectives):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="does not have: 'layers.0'; valid names: 0, 1"):
        compile_sharded(model, buckets=[["0"], ["layers.0"]])


def test_manual_plan_puts_a_parameter_in_two_buckets(no_collectives):
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="parameter '0.0.weight' is in 2 buckets .* one bucket only"):
        compile_sharded(model, buckets=[["0"], ["0.0", "1"]])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"buckets": [["0"], "1"]}, "buckets must be 'auto', 'block', None or a list of lists of module names"),
        ({"prefetch": -1}, "prefetch must be a whole number of buckets"),
        ({"reorder": "yes"}, "reorder must be True or False"),
        ({"memory_budget": 0}, "memory_budget must be a positive number of bytes"),
        ({"blocks": "0"}, "blocks must be a list of module names"),
        ({"blocks": ["0", "layers.1"]}, "blocks= names module\\(s\\) that Sequential does not have: 'layers.1'"),
        ({"options": {"post_grad_custom_post_pass": None}}, "post_grad_custom_post_pass'\\] is taken by simplefsdp"),
    ],
)
def test_bad_pass_options(no_collectives, options, message):
    with pytest.raises((TypeError, ValueError), match=message):
        compile_sharded(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), **options)


def test_decorator_form_checks_bucket_mode_at_once():
    with pytest.raises(ValueError, match="unknown bucket mode"):
        compile_sharded(buckets="layers")


def test_a_meta_model_called_before_materialize_sharded_is_refused_before_compiling(fake_world):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    compile_sharded(model, backend="aot_eager")  # refused ahead of any backend
    with pytest.MonkeyPatch.context() as patch:
        for name in ("all_gather_object", "broadcast", "all_gather", "all_reduce"):
            patch.setattr(dist, name, _collective_issued)
        graphs = compiled_graphs()
        with pytest.raises(RuntimeError, match="still on the meta device .* call simplefsdp.materialize_sharded"
                           r"\(model\) after compile_sharded"):
            model(torch.randn(2, 4))
        assert compiled_graphs() == graphs  # refused before Dynamo traced (Inductor failed some 40 s into the call)
    materialize_sharded(model, init_fn=lambda: [nn.init.zeros_(param) for param in model.parameters()])
    assert model(torch.randn(2, 4)).shape == (2, 4) and compiled_graphs() == graphs + 1
