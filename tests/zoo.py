"""The zoo: models from libraries this project does not own, and the shapes users bring, built tiny from configs.

Each entry builds its model from seed 0 (random init, no download), makes a global batch per step, and names its
reference: ``"process"`` (one process on the whole batch) or ``"ddp"`` (``DistributedDataParallel`` on the same
ranks, where batch statistics make one process train another model). Shapes are picked so that some parameters
shard unevenly or leave a rank empty on 2 ranks (first dimensions 1, 3, 5, 33, 101). Language models run without a
key-value cache (``use_cache=False``), as in training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scenarios import gamma, U

VOCAB, TOKENS = 101, 16


@dataclass(frozen=True)
class ZooModel:
    """``build()`` a model; ``batch(step, size)`` → (positional inputs, target); ``loss(output, target)``."""
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[tuple, torch.Tensor]]
    loss: Callable[[object, torch.Tensor], torch.Tensor]
    reference: str = "process"


def _tokens(step: int, size: int) -> tuple[tuple, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (size, TOKENS + 1), generator=torch.Generator().manual_seed(100 + step))
    return (tokens[:, :-1],), tokens[:, 1:]


def _encoder_decoder_tokens(step: int, size: int) -> tuple[tuple, torch.Tensor]:
    (source,), target = _tokens(step, size)
    decoder_inputs = torch.cat([torch.zeros_like(target[:, :1]), target[:, :-1]], dim=1)
    return (source, None, decoder_inputs), target  # input_ids, attention_mask, decoder_input_ids


def _features(shape: tuple[int, ...], classes: int) -> Callable[[int, int], tuple[tuple, torch.Tensor]]:
    def batch(step: int, size: int) -> tuple[tuple, torch.Tensor]:
        generator = torch.Generator().manual_seed(100 + step)
        features = torch.randn(size, *shape, generator=generator)
        return (features,), torch.randint(0, classes, (size,), generator=generator)

    return batch


def logits(output) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or a Hugging Face output's ``logits``."""
    return output if isinstance(output, torch.Tensor) else output.logits


def _cross_entropy(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits(output).flatten(0, -2).float(), target.flatten())


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    # cls_token (1, 1, 48) and position_embeddings (1, 17, 48): rank 1's shards are empty
    return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=96, num_labels=10))


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
                                            num_experts_per_tok=2, max_position_embeddings=32, use_cache=False))


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)


def _lora_llama() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(_tiny_llama_config())
    # rank 3 adapters: lora_A is (3, 32), split 2 + 1; init_lora_weights=False: B is random, so A trains from step 1
    return get_peft_model(model, LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=1,
                                               num_decoder_layers=1, num_heads=4, relative_attention_num_buckets=5,
                                               dropout_rate=0.0, decoder_start_token_id=0,
                                               use_cache=False))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # the output layer is the token embedding (tied); 33 positions split 17 + 16
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=33, n_embd=32, n_layer=1, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


class BatchNormCNN(nn.Module):
    """Two convolutions with batch norm: its batch statistics are each rank's own, as in DDP."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.ReLU(),
                                      nn.Conv2d(5, 7, 3), nn.BatchNorm2d(7), nn.ReLU())
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class RootParameter(nn.Module):
    """A parameter directly on the root module (3 elements: split 2 + 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(3))
        self.proj = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.offset


class LearnedTemperature(nn.Module):
    """A one-element parameter of no dimension (a learned scalar: replicated, it has no dim 0 to shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.7))
        self.proj = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) / self.temperature


class FewerElementsThanRanks(nn.Module):
    """A parameter of 1 element, fewer than the ranks: every rank but the first holds an empty shard."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([1.3]))
        self.proj = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.gain


ZOO = {
    "vit": ZooModel(_vit, _features((3, 32, 32), 10), _cross_entropy),
    "mixtral": ZooModel(_mixtral, _tokens, _cross_entropy),
    "lora_llama": ZooModel(_lora_llama, _tokens, _cross_entropy),
    "t5": ZooModel(_t5, _encoder_decoder_tokens, _cross_entropy),
    "gpt2": ZooModel(_gpt2, _tokens, _cross_entropy),
    "batchnorm_cnn": ZooModel(BatchNormCNN, _features((3, 8, 8), 3), _cross_entropy, reference="ddp"),
    "root_parameter": ZooModel(RootParameter, _features((8,), 3), _cross_entropy),
    "learned_temperature": ZooModel(LearnedTemperature, _features((8,), 3), _cross_entropy),
    "fewer_elements_than_ranks": ZooModel(FewerElementsThanRanks, _features((8,), 3), _cross_entropy),
}


def build(name: str) -> nn.Module:
    """Zoo model ``name``, initialized from seed 0."""
    torch.manual_seed(0)
    return ZOO[name].build()


# fp32 bound on one forward+backward of a zoo model computed twice in another order (Inductor's kernels, a batch
# split over ranks), derived as scenarios.FORWARD_BACKWARD_BOUND:
# - the longest reduction is at most 256 terms: ViT's patch convolution (3 * 8 * 8 = 192), the 101-word vocabulary,
#   the tokens of a step (2 ranks x 2 x 17 ViT tokens, 2 x 2 x 16 words), the hidden sizes (32-96);
# - the dependent chain: at most 2 blocks (encoder + decoder, or 2 ViT layers) of at most 12 reductions (2 norms of 2
#   sums each, q, scores, softmax sum, probs @ v, output projection, router or gate, up, down), plus embedding norm,
#   final norm, output layer and the loss's 2 sums: 29 forward, 29 backward, 1 over ranks: 59, counted up to 64;
# - at most 2u for each of ~320 elementwise ops on that chain (GELU/SiLU, softmax's exp, norms' rsqrt, residuals),
#   twice the debug Llama's 160: these blocks hold up to twice its elementwise ops per reduction.
ZOO_BOUND = 64 * gamma(256) + 320 * 2 * U


def zoo_update_bound(initial: torch.Tensor, update: torch.Tensor, steps: int) -> float:
    """``scenarios.update_bound`` with the zoo's forward+backward bound: the gradients' differences, plus 2u of
    ``|p|`` per step for rounding ``p - lr * g`` to the parameter's ulp, relative to the update."""
    return ZOO_BOUND + 2 * steps * U * initial.norm().item() / update.norm().clamp_min(1e-30).item()
