"""Which errors the step-back from regions takes for a compiler's failure (``runtime/regions_step_back.py:
compiler_failure``): Dynamo's and Inductor's, not the recompile limit, not the model's own."""

from __future__ import annotations

import torch

from simplefsdp.runtime.regions_step_back import compiler_failure


def _raised_from(error: Exception, cause: Exception) -> Exception:
    try:
        raise error from cause
    except Exception as raised:
        return raised


def _raised_by_module(module: str, error: Exception) -> Exception:
    """``error`` as raised by a function of ``module``'s code."""
    namespace = {"__name__": module, "error": error}
    exec("def fail():\n    raise error", namespace)
    try:
        namespace["fail"]()
    except Exception as raised:
        return raised


def test_only_a_compile_failure_steps_back_and_not_dynamos_recompile_limit():
    """The step-back takes errors Dynamo or Inductor raised, or wrapped, with their reason, and bare errors raised in
    their code (torch 2.13's Dynamo asserted "Freevar has no source" in its reuse of a traced region on a block reading
    its input's ``x.mT``, before regions read their inputs through aliases); not the recompile limit, which
    ``runtime/compile.py`` raises on purpose on one rank (a whole graph there would issue collectives the other ranks'
    graphs do not), nor an error of the model's own."""
    failure = _raised_from(RuntimeError("while compiling"),
                           torch._dynamo.exc.InternalTorchDynamoError("RuntimeError: the region cannot run"))
    assert compiler_failure(failure) == "InternalTorchDynamoError: RuntimeError: the region cannot run"
    bare = _raised_by_module("torch._dynamo.variables.invoke_subgraph", AssertionError("Freevar has no source"))
    assert compiler_failure(bare) == "AssertionError: Freevar has no source"
    # Inductor's ``assert not waiting`` in its topological sort, on the cycle Gemma 3n's plan made, said nothing
    silent = _raised_by_module("torch._inductor.pattern_matcher", AssertionError())
    assert compiler_failure(silent) == "AssertionError: raised in torch._inductor.pattern_matcher"
    limit = _raised_from(RuntimeError("Dynamo hit its recompile limit"), torch._dynamo.exc.FailOnRecompileLimitHit())
    assert compiler_failure(limit) is None
    assert compiler_failure(ValueError("the model's own error")) is None
    assert compiler_failure(_raised_by_module("transformers.models.falcon", AssertionError("the model's"))) is None
