"""What a Hugging Face model needs once sharded: ``save_pretrained`` refused without a full state dict (with the
recipe), its output-capturing hooks installed before any compile, its key-value cache off in training, and the fix
of the graph break its speech models' feature encoders make."""

from __future__ import annotations

import inspect
import sys
from typing import Callable

from torch import nn

SAVE_RECIPE = (
    "gather the full state dict on every rank, then save it on rank 0: full = get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) (torch.distributed.checkpoint.state_dict), "
    "then model.save_pretrained(DIR, state_dict=dict(full)) on rank 0 "
    "(docs/models-from-other-libraries.md#saving-a-full-state-dict)")


def refuse_saving_shards(model: nn.Module) -> None:
    """Make ``model.save_pretrained(...)`` without ``state_dict=`` raise naming ``SAVE_RECIPE`` (it would read the
    sharded DTensors' storage and fail deep inside safetensors); with ``state_dict=`` it saves what it is given."""
    save_pretrained: Callable | None = getattr(model, "save_pretrained", None)
    if save_pretrained is None:
        return

    def save_gathered(save_directory, *args, state_dict=None, **kwargs):
        if state_dict is None:
            raise RuntimeError(f"save_pretrained() of a sharded {type(model).__name__} would save each rank's shards; "
                               f"{SAVE_RECIPE}")
        return save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)

    model.save_pretrained = save_gathered


def train_without_cache(model: nn.Module) -> None:
    """Call each Hugging Face model in ``model`` (its config turning the key-value cache on) with ``use_cache=False``
    in training where a call leaves it unset or None. Training reads no cache; passed to every block, it keeps the
    blocks out of regions (each compiled inline, as the whole graph) and under gradient checkpointing breaks the graph
    at every call. Eval calls and ``generate()`` (which passes ``use_cache=True``) keep it. Each model, not only the
    outermost: peft's LoRA calls its base model's ``forward`` directly, past the hooks."""
    for module in model.modules():
        if getattr(getattr(module, "config", None), "use_cache", False) is True and (
                "use_cache" in inspect.signature(type(module).forward).parameters):
            module.register_forward_pre_hook(_without_cache, with_kwargs=True)


def _without_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    return (args, {**kwargs, "use_cache": False}) if module.training and kwargs.get("use_cache") is None else None


def graph_break_fix(model: nn.Module, reasons: list[str]) -> str | None:
    """The fix of ``model``'s graph breaks (Dynamo's ``reasons``) where this library knows one, or None: Hugging
    Face's speech models' feature encoders (wav2vec2's) mark their input as requiring grad, which Dynamo cannot
    trace."""
    encoder = next((name for name, module in model.named_modules() if vars(module).get("_requires_grad") is True), None)
    if encoder is not None and any("requires_grad" in reason for reason in reasons):
        return (f"set model.{encoder}._requires_grad = False before training (the feature encoder marks its input as "
                "requiring grad, for gradient checkpointing; its parameters still train), or freeze it: "
                "model.freeze_feature_encoder()")
    return None


def install_output_capturing_hooks(model: nn.Module) -> None:
    """Install transformers' hooks that capture ``output_hidden_states`` and ``output_attentions`` now, on each model
    whose forward would (``capture_outputs``): transformers installs them at the first call that asks (wav2vec2's
    classifier always does) under a lock Dynamo cannot enter, a graph break that ``inspect`` cannot trace."""
    if "transformers" not in sys.modules:  # not a Hugging Face model: importing transformers would cost seconds
        return
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # transformers before 5: no hooks installed at a call
        return
    for module in model.modules():  # a forward wrapped by a function of output_capturing's: capture_outputs
        forward = type(module).forward
        while forward is not None and getattr(forward, "__globals__", {}).get("__name__") != (
                maybe_install_capturing_hooks.__module__):
            forward = getattr(forward, "__wrapped__", None)
        if forward is not None:
            maybe_install_capturing_hooks(module)
