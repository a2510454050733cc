"""What ``--model`` names for ``train``, ``inspect`` and ``bench``: a reference Llama (``cpu-small``), a Hugging Face
config (``hf:PATH``) or the user's own ``package.module:function``; each as a builder, a batch per step and a loss.

The user's function (docs/your-model.md) returns a module, or ``(module, batch)``, or ``(module, batch, loss)``:
``batch(step, rank, batch_size) -> (inputs, target)``, this rank's positional inputs of the forward and the loss's
target; ``loss(output, target) -> scalar``. Without ``batch``, the module takes token ids and returns logits (or an
output with ``.logits``), trained on ``--data``'s bytes (modulo its vocabulary) with ``token_loss``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from simplefsdp.data import load_tokens, rank_batch
from simplefsdp.passes.bucket_plan import find_blocks
from simplefsdp.models.llama import CONFIGS, LlamaConfig, build_model, get_config

Batch = tuple[tuple, torch.Tensor]  # the forward's positional inputs, the loss's target
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
HEADS = ("ForCausalLM", "ForSequenceClassification")


def token_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 of the logits (a tensor, an output's ``.logits``, a tuple's first): of each next token
    for ``(batch, seq, vocab)`` logits, of the class ``target[:, -1] % classes`` for ``(batch, classes)``."""
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    logits = output[0] if logits is None else logits
    if logits.dim() == 2:
        return F.cross_entropy(logits.float(), target[:, -1] % logits.shape[-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


class ModelWithLoss(nn.Module):
    """``model`` and its loss in one forward, ``(*inputs, target) -> loss``, as a Hugging Face model computes its loss
    from ``labels``: what compiles the model's forward can take the loss into the same graph."""

    def __init__(self, model: nn.Module, loss: Callable[[object, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *inputs_and_target) -> torch.Tensor:
        *inputs, target = inputs_and_target
        return self.loss(self.model(*inputs), target)


@dataclass
class Workload:
    """``builder()``: the model on the default device, initialized from torch's seed (unless on ``meta``), or a
    user's ``(model, batch[, loss])``. ``config``: a reference model's (tensor parallelism); ``width``: the hidden
    size (GaLore's default rank); ``attention``: its layers and query width (heads x head dim), where MFU counts."""

    name: str
    builder: Callable[[], nn.Module | tuple]
    config: LlamaConfig | None = None
    max_seq_len: int | None = None
    width: int | None = None
    loss: Callable[[object, torch.Tensor], torch.Tensor] = token_loss
    user_batch: Callable[[int, int, int], Batch] | None = None
    attention: tuple[int, int] | None = None

    def build(self, seed: int) -> nn.Module:
        """A fresh model initialized from ``seed`` (on ``meta``: not initialized); a user's function also sets the
        workload's batch and loss where it returns them."""
        torch.manual_seed(seed)
        built = self.builder()
        parts = built if isinstance(built, tuple) else (built,)
        if not isinstance(parts[0], nn.Module) or len(parts) > 3:
            raise ValueError(f"--model {self.name}: the function must return an nn.Module, (module, batch) or "
                             f"(module, batch, loss), and returned {type(built).__name__}; see docs/your-model.md")
        if len(parts) > 1:
            self.user_batch = parts[1]
        if len(parts) > 2:
            self.loss = parts[2]
        model = parts[0]
        if self.config is not None and next(model.parameters()).device.type != "meta":
            torch.manual_seed(seed)
            model.init_weights()
        return model

    def tokens(self, model: nn.Module, path: str | None, seed: int) -> torch.Tensor:
        """``--data``'s tokens (synthetic bytes without it), modulo ``model``'s vocabulary where it is smaller."""
        tokens = load_tokens(path, seed)
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        return tokens % embedding.num_embeddings if embedding is not None else tokens

    def batch(self, tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int, rank: int,
              world: int) -> Batch:
        """This rank's inputs and target of ``step``: the user's, or ``rank_batch``'s windows shifted by one."""
        if self.user_batch is not None:
            return self.user_batch(step, rank, batch_size)
        windows = rank_batch(tokens, step, batch_size, seq_len, seed, rank, world)
        return (windows[:, :-1],), windows[:, 1:]


def micro_batches(batch: Batch, count: int, device: torch.device | str) -> list[Batch]:
    """``batch`` on ``device`` cut into ``count`` micro-batches along the first dimension of every tensor."""
    inputs, target = batch

    def cut(value):
        return value.to(device).chunk(count) if isinstance(value, torch.Tensor) else [value] * count

    columns = [cut(value) for value in (*inputs, target)]
    return [(tuple(column[index] for column in columns[:-1]), columns[-1][index]) for index in range(count)]


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` that ``compile_sharded`` finds (what checkpointing and FSDP2 wrap)."""
    return [model.get_submodule(name) for name in find_blocks(model)]


def load_workload(spec: str, layers: int | None = None) -> Workload:
    """The workload ``--model spec`` names, with ``layers`` blocks where given; ``ValueError`` naming the fix."""
    if spec in CONFIGS:
        config = get_config(spec)
        return Workload(spec, partial(build_model, spec, n_layers=layers), config, config.max_seq_len, config.dim,
                        attention=(layers or config.n_layers, config.dim))
    if spec.startswith("hf:"):
        return _hugging_face(spec, Path(spec[3:]), layers)
    if ":" in spec:
        return _users(spec, layers)
    raise ValueError(f"--model {spec}: not a reference model ({', '.join(CONFIGS)}), hf:PATH (a Hugging Face "
                     "config.json or model folder) or package.module:function (your own model)")


def _hugging_face(spec: str, path: Path, layers: int | None) -> Workload:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--model {spec} builds a Hugging Face model: pip install transformers") from None
    folder = path.parent if path.is_file() else path
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {spec}: no config.json at {path}; pass a model folder or its config.json")
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    head = (config.architectures or ["AutoModelForCausalLM"])[0]
    if not head.endswith(HEADS) or not hasattr(transformers, head):
        raise ValueError(f"--model {spec}: {head} is not a causal-LM or sequence-classification model; build it in a "
                         "function returning (model, batch, loss) and pass --model package.module:function")
    if layers is not None:
        config.num_hidden_layers = layers
    config.use_cache = False  # Hugging Face's key-value cache serves generation; training passes none
    if head.endswith("ForSequenceClassification") and config.pad_token_id is None:
        config.pad_token_id = -1  # no token is padding: each sequence is classified at its last token
    weighted = path.is_dir() and any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES)
    model_class = getattr(transformers, head)
    # a config.json that names no architecture: the Auto class builds its model type's causal LM (only a concrete
    # class has _from_config, which keeps the config's attention implementation)
    from_config = model_class.from_config if head.startswith("Auto") else model_class._from_config

    def builder() -> nn.Module:
        if weighted and torch.get_default_device().type != "meta":
            return model_class.from_pretrained(folder, config=config, local_files_only=True, dtype=torch.float32)
        return from_config(config, dtype=torch.float32)

    return Workload(spec, builder, max_seq_len=getattr(config, "max_position_embeddings", None),
                    width=getattr(config, "hidden_size", None), attention=_attention(config))


def _attention(config) -> tuple[int, int] | None:
    """A Hugging Face config's layers and query width (heads x head dim); None for a mixture of experts (each token
    runs a few of its weights, which PaLM's accounting does not count) or a config that does not name them."""
    if getattr(config, "num_experts_per_tok", None) or not all(
            hasattr(config, key) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size")):
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_attention_heads * head_dim


def _users(spec: str, layers: int | None) -> Workload:
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--model {spec}: cannot load {function_name} from {module_name} ({error}); the module "
                         "must be importable from here (its folder on PYTHONPATH) and define the function") from None
    return Workload(spec, function if layers is None else partial(function, layers=layers))
