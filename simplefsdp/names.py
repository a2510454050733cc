"""The names the command line offers, importable without torch so that ``--help`` answers at once (ARCHITECTURE.md);
the modules that act on a name take it from here (tests/test_cli.py pins the tables keyed elsewhere)."""

from __future__ import annotations

MODEL_NAMES = ("debug", "cpu-small", "llama3-8b", "llama3-70b")  # the keys of models.llama.CONFIGS
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch dtypes, as torch names its attributes
PROFILE_NAMES = ("h100", "a100", "h100-100g", "cpu")  # ir.hardware's built-in profiles, then the measured CPU
# bench.contenders.CONTENDERS's names, FSDP2 eager (the reference) first
CONTENDER_NAMES = ("fsdp2-eager", "simplefsdp", "simplefsdp-nopasses", "simplefsdp-int8", "simplefsdp-replicate",
                   "fsdp2-compile", "ddp-compile", "local")
MODES = ("fully_shard", "replicate", "hybrid_shard")  # compile_sharded's layouts
AC_MODES = ("none", "full", "selective")  # activation checkpointing per block
DEVICES = ("meta", "cuda")  # what a fake world traces on: the meta device, or fake CUDA tensors
SYNC_MODES = ("step", "demo", "diloco")  # what crosses fault-tolerant replica groups
# train's optimizers, each with its learning rate without --lr: torchtitan's AdamW default; GaLore's recommended
# rate for small Llamas (its update is scaled by 0.25; benchmarks/galore.md)
DEFAULT_LR = {"adamw": 1e-3, "galore": 1e-2}
