"""Training tokens: bytes of a text file, or a synthetic corpus with learnable structure."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 256


def synthetic_corpus(num_tokens: int = 1 << 18, seed: int = 0) -> torch.Tensor:
    """Bytes drawn from a fixed random Markov chain in which each byte has 4 possible successors."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB_SIZE, (VOCAB_SIZE, 4), generator=generator).tolist()
    choices = torch.randint(0, 4, (num_tokens,), generator=generator).tolist()
    tokens = [0]
    for choice in choices[1:]:
        tokens.append(successors[tokens[-1]][choice])
    return torch.tensor(tokens, dtype=torch.long)


def load_tokens(path: str | None, seed: int = 0) -> torch.Tensor:
    """Byte-level tokens of the file at ``path``, or the synthetic corpus when ``path`` is None."""
    if path is None:
        return synthetic_corpus(seed=seed)
    data = Path(path).read_bytes()
    if len(data) < 2:
        raise ValueError(f"--data {path}: the file holds {len(data)} bytes; training needs a longer text")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def rank_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int, rank: int,
               world: int) -> torch.Tensor:
    """This rank's ``batch_size`` rows of the step's ``batch_size * world`` windows of ``seq_len + 1`` tokens at
    offsets fixed by ``(seed, step)``."""
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"the data holds {len(tokens)} tokens; --seq-len {seq_len} needs more than {seq_len + 1}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size * world,), generator=generator)
    return torch.stack([tokens[start : start + seq_len + 1] for start in starts.tolist()]).chunk(world)[rank]


def step_seq_len(step: int, seq_len: int, seed: int) -> int:
    """A sequence length in ``[max(2, seq_len // 2), seq_len]`` fixed by ``(seed, step)``, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 - step)
    return int(torch.randint(max(2, seq_len // 2), seq_len + 1, (), generator=generator))
