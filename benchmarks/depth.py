"""Cold first step at depth under the defaults: Hugging Face Llama beside the library's own Llama (issue 62), and
a ResNet of batch-normed residual blocks (``tests/zoo.py``'s, 16 channels, 8 images of 16 x 16).

    python benchmarks/depth.py --layers 2 16 32 --out benchmarks/depth.md

Each run is a fresh process with an empty Inductor cache directory, on a 1-rank gloo world (``compile_sharded``'s
defaults: Inductor, ``buckets="auto"``, ``compile_blocks_once=None``); it times the first forward, backward and
AdamW step (the compile) and the median of the next three. Hugging Face's layers differ in ``layer_idx``, so the
default shares one region among them, its ``layer_idx`` unreadable; the library's blocks are alike. The contenders
named ``-whole-graph`` are the same models as the whole graph (``compile_blocks_once=False``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("hf-llama", "simplefsdp-debug", "hf-llama-whole-graph", "resnet", "resnet-whole-graph")


def _model_and_batch(model_name: str, layers: int) -> tuple:
    """``model_name`` with ``layers`` blocks, its input and its classes' targets."""
    import torch

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    if model_name.startswith("resnet"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from zoo import ResNet
        return (ResNet(layers, channels=16), torch.randn(8, 3, 16, 16, generator=generator),
                torch.randint(0, 3, (8,), generator=generator))
    tokens = torch.randint(0, 256, (2, 65), generator=generator)
    if model_name.startswith("hf-llama"):
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192,
                                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=128, use_cache=False))
    else:
        from simplefsdp.models.llama import build_model
        model = build_model("debug", n_layers=layers)
    return model, tokens[:, :-1], tokens[:, 1:]


def one_run(model_name: str, layers: int) -> dict:
    """Build ``model_name`` with ``layers`` blocks, shard and compile it by default, time its steps."""
    import torch
    import torch.nn.functional as F

    from simplefsdp import compile_sharded
    from simplefsdp.runtime.block_regions import _run_block

    model, inputs, targets = _model_and_batch(model_name, layers)
    model = compile_sharded(model, compile_blocks_once=False if model_name.endswith("whole-graph") else None)
    regions = any(getattr(vars(m).get("forward"), "func", None) is _run_block for m in model.modules())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seconds = []
    for _ in range(4):
        start = time.perf_counter()
        output = model(inputs)
        logits = output if isinstance(output, torch.Tensor) else output.logits
        F.cross_entropy(logits.flatten(0, -2), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    return {"first": seconds[0], "step": statistics.median(seconds[1:]), "regions": regions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 16, 32])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a child run: model, layers
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], int(args.one[1]))))
        return
    rows = ["| model | layers | compiled as | cold first step | x the 2-layer | steady step |",
            "| --- | --- | --- | --- | --- | --- |"]
    for model_name in args.models:
        base = None
        for layers in args.layers:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"}
                done = subprocess.run([sys.executable, __file__, "--one", model_name, str(layers)], env=env,
                                      capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            base = base or result["first"]
            rows.append(f"| {model_name} | {layers} | {'regions' if result['regions'] else 'whole graph'} | "
                        f"{result['first']:.1f} s | {result['first'] / base:.2f}x | {result['step'] * 1e3:.0f} ms |")
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    if args.out:
        with open(args.out, "a") as file:
            file.write(table + "\n")


if __name__ == "__main__":
    main()
