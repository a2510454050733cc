"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The model knows nothing about sharding. Sizes are named in ``CONFIGS``; ``debug``
is for tests, ``cpu-small`` trains on a CPU, the Llama 3 shapes are for tracing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style model."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width as Llama computes it: 2/3 of 4*dim, scaled, rounded up to ``multiple_of``."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


CONFIGS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=128),
    "cpu-small": LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, multiple_of=64,
                             max_seq_len=512),
    "llama3-8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
        ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192,
    ),
    "llama3-70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
        ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192,
    ),
}


def get_config(name: str) -> LlamaConfig:
    """The named config; an unknown name raises ``ValueError`` listing the known ones."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(CONFIGS)}")
    return CONFIGS[name]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of the rotary angles, stacked: shape ``(2, max_seq_len, head_dim // 2)``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` (batch, seq, heads, head_dim) by the angles in ``rope``."""
    cos = rope[0, : x.shape[1]].unsqueeze(1)
    sin = rope[1, : x.shape[1]].unsqueeze(1)
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism (models/llama_tp.py) a rank holds n_heads / tp of them
        q = apply_rotary(self.wq(x).view(batch, seq, -1, self.head_dim), rope)
        k = apply_rotary(self.wk(x).view(batch, seq, -1, self.head_dim), rope)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token ids ``(batch, seq)`` in, logits ``(batch, seq, vocab)`` out."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope", rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta), persistent=False
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic given the global RNG state: normal embeddings, depth-scaled linears, unit norms.

        Also recomputes the rotary table, so a model built on ``meta`` is fully set by this call.
        """
        self.rope.copy_(rotary_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta))
        nn.init.normal_(self.tok_embeddings.weight)
        depth_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for layer in self.layers:
            for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1):
                nn.init.trunc_normal_(linear.weight, std=0.02)
            for linear in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
                nn.init.trunc_normal_(linear.weight, std=depth_std)
            layer.attention_norm.weight.fill_(1.0)
            layer.ffn_norm.weight.fill_(1.0)
        self.norm.weight.fill_(1.0)
        if not self.config.tie_embeddings:
            nn.init.trunc_normal_(self.output.weight, std=self.config.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope)
        return self.output(self.norm(x))


def build_model(name: str, **overrides) -> Llama:
    """A freshly initialized model of the named size; ``overrides`` replace config fields (``None`` keeps a field)."""
    config = get_config(name)
    if overrides := {field: value for field, value in overrides.items() if value is not None}:
        config = LlamaConfig(**{**config.__dict__, **overrides})
    return Llama(config)
