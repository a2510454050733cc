"""The zoo: models from libraries this project does not own, and the shapes users bring, built tiny from configs.

Each entry builds its model from seed 0 (random init, no download), makes a global batch per step, and names its
reference: ``"process"`` (one process on the whole batch) or ``"ddp"`` (``DistributedDataParallel`` on the same
ranks, where batch statistics make one process train another model). Shapes are picked so that some parameters
shard unevenly or leave a rank empty on 2 ranks (first dimensions 1, 3, 5, 33, 257). The decoders built from
``_decoder_config`` (Llama, Gemma 3, DeepSeek-V3, Qwen2, LoRA's Llama) keep Hugging Face's default key-value cache
(``use_cache=True``), which ``compile_sharded`` turns off in training calls; the others run without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scenarios import gamma, U

# 257 words: 4 x 2 ranks x 32 tokens a rank <= 257 rows, so an untied embedding is looked up where it is sharded (the
# default's rule in ``runtime/sharded_lookup.py``), not gathered
VOCAB, TOKENS = 257, 16


@dataclass(frozen=True)
class ZooModel:
    """``build(layers)`` a model of ``layers`` blocks (the zoo trains ``depth``: real depths, tiny widths);
    ``batch(step, size)`` → (positional inputs, target); ``loss(output, target)``. ``chain``: how many blocks lie on
    the longest dependent chain at ``depth``, for the error bound."""
    build: Callable[[int], nn.Module]
    batch: Callable[[int, int], tuple[tuple, torch.Tensor]]
    loss: Callable[[object, torch.Tensor], torch.Tensor]
    depth: int = 1
    reference: str = "process"
    stacks: int = 1  # T5: an encoder, then a decoder of ``depth`` blocks each

    @property
    def chain(self) -> int:
        return self.stacks * self.depth


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


def _vit(layers: int) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    # cls_token (1, 1, 48) and position_embeddings (1, 17, 48): rank 1's shards are empty
    return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=layers,
                                               num_attention_heads=4, intermediate_size=96, num_labels=10))


def _convnext(layers: int) -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    # ConvNeXt-T's stages of 3, 3, 9 and 3 blocks at 18 layers (a 7x7 depthwise convolution, then linear layers over
    # the channels, moved last); layer scale 0.5, not 1e-6, so that every block's weights move the loss
    return ConvNextForImageClassification(ConvNextConfig(hidden_sizes=[8, 16, 32, 64], layer_scale_init_value=0.5,
                                                         depths=[max(1, layers // share) for share in (6, 6, 2, 6)],
                                                         num_labels=3))


def _wav2vec2(layers: int) -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    # two convolutions over the waveform (400 samples: 39 frames), a grouped positional convolution under weight norm,
    # then the transformer layers; no dropout, masking or layer drop (random); the fix the graph break's error names
    model = Wav2Vec2ForSequenceClassification(Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        num_labels=3, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0))
    model.wav2vec2.feature_extractor._requires_grad = False
    return model


def _mixtral(layers: int) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=32,
                                            use_cache=False))


def _decoder_config(config_class, layers: int, **options):
    return config_class(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32), **options})


def _llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(_decoder_config(LlamaConfig, layers))


def _gemma3(layers: int) -> nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # every sixth layer full attention, the others a sliding window of 8 of the 16 tokens; tied embedding
    return Gemma3ForCausalLM(_decoder_config(Gemma3TextConfig, layers, head_dim=8, sliding_window=8))


def _deepseek_v3(layers: int) -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # multi-head latent attention (queries and keys-values through low-rank projections, a rotary part of each head
    # apart); the first layer's MLP dense, the others' 3 routed experts (2 a token) stacked in one parameter beside a
    # shared expert
    return DeepseekV3ForCausalLM(_decoder_config(
        DeepseekV3Config, layers, num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=3, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=16, n_group=1, topk_group=1))


def _falcon(layers: int) -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    # Falcon 40B's and 180B's layout: query, key and value in one projection, 2 key-value heads, attention and MLP
    # side by side, each from its own norm; tied embedding
    return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                                          num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                          max_position_embeddings=32, use_cache=False))


def _qwen2(layers: int) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(_decoder_config(Qwen2Config, layers))  # q, k, v with biases


def _lora_llama(layers: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    # rank 3 adapters: lora_A is (3, 32), split 2 + 1; init_lora_weights=False: B is random, so A trains from step 1
    return get_peft_model(_llama(layers), LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0, init_lora_weights=False))


def _t5(layers: int) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    # one embedding read three ways: the encoder's, the decoder's and the output layer (tied)
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=layers,
                                               num_decoder_layers=layers, num_heads=4,
                                               relative_attention_num_buckets=5, dropout_rate=0.0,
                                               decoder_start_token_id=0, use_cache=False))


def _gpt2(layers: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # the output layer is the token embedding (tied); 33 positions split 17 + 16
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=33, n_embd=32, n_layer=layers, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


def _bert(layers: int) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    # the prediction head's decoder is the word embedding (tied)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                                      num_attention_heads=4, intermediate_size=48, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class ComplexRotaryLlama(nn.Module):
    """A Llama written as torchtitan writes it: rotary embedding by complex multiplication (``freqs_cis`` from
    ``torch.polar``, a buffer of the root passed to every block, queries and keys through ``view_as_complex``), causal
    SDPA, RMSNorm, SwiGLU."""

    def __init__(self, layers: int, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(_ComplexRotaryBlock(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        half = dim // heads // 2
        angles = torch.outer(torch.arange(TOKENS).float(), 1.0 / 10000 ** (torch.arange(half).float() / half))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens)
        for layer in self.layers:
            hidden = layer(hidden, self.freqs_cis[:tokens.shape[1]])
        return self.output(self.norm(hidden))


class _ComplexRotaryBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, 48, bias=False), nn.Linear(dim, 48, bias=False)
        self.w2 = nn.Linear(48, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(batch, tokens, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        q, k = (torch.view_as_real(torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
                                   * freqs_cis[None, :, None]).flatten(3).type_as(t) for t in (q, k))
        attention = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True)
        x = x + self.wo(attention.transpose(1, 2).reshape(batch, tokens, dim))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ResNet(nn.Module):
    """A ResNet of ``layers`` repeated residual blocks (3x3 convolution, batch norm, ReLU, twice): its batch
    statistics are each rank's own, as in DDP."""

    def __init__(self, layers: int, channels: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.layers = nn.Sequential(*(_ResidualBlock(channels) for _ in range(layers)))
        self.head = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


class _ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = (nn.Conv2d(channels, channels, 3, padding=1, bias=False) for _ in range(2))
        self.bn1, self.bn2 = nn.BatchNorm2d(channels), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def _batchnorm_sequential(layers: int) -> nn.Module:
    """A root ``nn.Sequential`` CNN with two equal batch norms, which ``find_blocks`` takes for repeated blocks."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


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
    "llama": ZooModel(_llama, _tokens, _cross_entropy, depth=80),
    "qwen2": ZooModel(_qwen2, _tokens, _cross_entropy, depth=24),
    "gemma3": ZooModel(_gemma3, _tokens, _cross_entropy, depth=12),
    "gpt2": ZooModel(_gpt2, _tokens, _cross_entropy, depth=12),
    "bert": ZooModel(_bert, _tokens, _cross_entropy, depth=12),
    "t5": ZooModel(_t5, _encoder_decoder_tokens, _cross_entropy, depth=8, stacks=2),
    "vit": ZooModel(_vit, _features((3, 32, 32), 10), _cross_entropy, depth=12),
    "convnext": ZooModel(_convnext, _features((3, 32, 32), 3), _cross_entropy, depth=18),
    "wav2vec2": ZooModel(_wav2vec2, _features((400,), 3), _cross_entropy, depth=12),
    "complex_rotary_llama": ZooModel(ComplexRotaryLlama, _tokens, _cross_entropy, depth=16),
    "resnet": ZooModel(ResNet, _features((3, 8, 8), 3), _cross_entropy, depth=8, reference="ddp"),
    "batchnorm_sequential": ZooModel(_batchnorm_sequential, _features((3, 8, 8), 3), _cross_entropy,
                                     reference="ddp"),
    "mixtral": ZooModel(_mixtral, _tokens, _cross_entropy, depth=8),
    "deepseek_v3": ZooModel(_deepseek_v3, _tokens, _cross_entropy, depth=8),
    "falcon": ZooModel(_falcon, _tokens, _cross_entropy, depth=8),
    "lora_llama": ZooModel(_lora_llama, _tokens, _cross_entropy),
    "root_parameter": ZooModel(lambda layers: RootParameter(), _features((8,), 3), _cross_entropy),
    "learned_temperature": ZooModel(lambda layers: LearnedTemperature(), _features((8,), 3), _cross_entropy),
    "fewer_elements_than_ranks": ZooModel(lambda layers: FewerElementsThanRanks(), _features((8,), 3),
                                          _cross_entropy),
}


def build(name: str, layers: int | None = None) -> nn.Module:
    """Zoo model ``name`` of ``layers`` blocks (default: its depth), initialized from seed 0."""
    torch.manual_seed(0)
    return ZOO[name].build(ZOO[name].depth if layers is None else layers)


# fp32 bound on one forward+backward of a zoo model computed twice in another order (Inductor's kernels, a batch
# split over ranks), derived as scenarios.FORWARD_BACKWARD_BOUND:
# - the longest reduction is at most 257 terms: ViT's patch convolution (3 * 8 * 8 = 192), ConvNeXt's last linear
#   layer (4 * 64 = 256 inputs), wav2vec2's positional convolution (16 taps x 8 channels), the 257-word vocabulary,
#   the tokens of a step (2 ranks x 2 x 17 ViT tokens, 2 x 2 x 16 words), the hidden sizes (32-96), a 3x3 convolution
#   over 8 channels (72), a batch norm's statistics over a rank's 2 x 8 x 8 pixels (128);
# - the dependent chain: ``chain`` blocks of at most 12 reductions each (2 norms of 2 sums each, q, scores, softmax
#   sum, probs @ v, output projection, router or gate, up, down; a residual block's 2 convolutions and 2 batch norms
#   hold 6, a ConvNeXt block 5, which leaves room for its stem's and 3 downsampling layers' 3 each), plus embedding
#   norm, final norm, output layer and the loss's 2 sums: 12 * chain + 5 forward, as many backward, 1 over ranks;
# - at most 2u for each of ~160 elementwise ops per block on that chain (GELU/SiLU, softmax's exp, norms' rsqrt,
#   residuals, rotary products), twice the debug Llama's 80 per block.
# Worst-case bounds grow linearly with depth: at 80 blocks (Llama's) about 3.1e-2, where rounding errors of random
# sign grow like the square root of the chain (Higham and Mary, 2019); the check still tells a wrong gradient (order 1)
# apart.
def zoo_bound(chain: int) -> float:
    """The relative bound on one forward+backward of a zoo model with ``chain`` blocks on its longest chain."""
    return (2 * (12 * chain + 5) + 1) * gamma(257) + 160 * chain * 2 * U


def zoo_update_bound(chain: int, initial: torch.Tensor, update: torch.Tensor, steps: int) -> float:
    """``scenarios.update_bound`` with the zoo's forward+backward bound: the gradients' differences, plus 2u of
    ``|p|`` per step for rounding ``p - lr * g`` to the parameter's ulp, relative to the update."""
    return zoo_bound(chain) + 2 * steps * U * initial.norm().item() / update.norm().clamp_min(1e-30).item()
