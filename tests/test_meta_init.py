"""Meta-device init: only shards are allocated, and the full parameters equal the unsharded model's init."""

from __future__ import annotations

import pytest
import torch
from ranks import run_on_ranks

from simplefsdp import compile_sharded, materialize_sharded
from simplefsdp.models.llama import build_model

SEED = 7


def _meta_vs_unsharded():
    """Eager (compile=False): initialization does not involve Inductor."""
    with torch.device("meta"):
        model = build_model("debug")
    compile_sharded(model, compile=False)
    torch.manual_seed(SEED)
    materialize_sharded(model)
    reference = build_model("debug")
    torch.manual_seed(SEED)
    reference.init_weights()
    expected = dict(reference.named_parameters())
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    mismatched = [name for name, p in model.named_parameters() if not torch.equal(p.full_tensor(), expected[name])]
    return mismatched, torch.equal(model.rope, reference.rope), local_numel, sum(p.numel() for p in expected.values())


def test_meta_init_equals_unsharded_init():
    for mismatched, rope_equal, local_numel, total_numel in run_on_ranks(2, _meta_vs_unsharded):
        assert mismatched == []
        assert rope_equal
        assert local_numel < total_numel  # each rank holds only its shards


def test_materialize_rejects_a_model_that_was_not_sharded():
    with pytest.raises(ValueError, match="built on 'meta' and passed through compile_sharded first"):
        materialize_sharded(build_model("debug"))
