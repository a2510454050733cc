"""What compiling each block once costs in memory at run time, side by side: a Hugging Face Llama on long sequences
as the whole graph, in regions as they were (each region making and saving its own attention bias of the causal
mask), and in regions as they are (``passes/region_inputs.py: compute_biases_once``: the bias made once, outside).

    python benchmarks/region_memory.py

One process (``compile_sharded``'s own 1-rank world), Inductor with its caches off (each variant compiles its own
graphs), SGD. Each variant runs in a fresh process: 6 steps, the median of steps 3-6, then one more step under
torch.profiler, whose CPU allocations give the most bytes live at once in that step.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("whole graph", "regions, a bias per block", "regions, the bias made once")
LAYERS, SEQ_LEN = 8, 2048


def run(variant: str) -> str:
    """One variant's markdown row."""
    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    import simplefsdp
    import simplefsdp.passes.region_inputs as region_inputs

    if variant == VARIANTS[1]:  # the pass as it was before compute_biases_once
        region_inputs.compute_biases_once = lambda gm: 0
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=SEQ_LEN)
    torch.manual_seed(0)
    # None, the default: the blocks differ in layer_idx, which their compute does not read, so they share one region
    model = simplefsdp.compile_sharded(LlamaForCausalLM(config),
                                       compile_blocks_once=False if variant == VARIANTS[0] else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = torch.randint(0, 300, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        begin = time.perf_counter()
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - begin

    times = [step() for _ in range(6)][2:]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        events.append(stack.pop())
        stack.extend(events[-1].children)
    live, total, peak = {}, 0, 0
    for event in sorted(events, key=lambda event: event.start_time_ns):
        if event.tag == _EventType.Allocation and str(event.extra_fields.device).startswith("cpu"):
            total -= live.pop(event.extra_fields.ptr, 0)
            if event.extra_fields.alloc_size > 0:
                live[event.extra_fields.ptr] = event.extra_fields.alloc_size
                total += event.extra_fields.alloc_size
            peak = max(peak, total)
    return (f"| {variant} | {peak / 2**20:.1f} | {statistics.median(times) * 1e3:.0f} "
            f"({', '.join(f'{t * 1e3:.0f}' for t in times)}) |")


def main() -> None:
    if len(sys.argv) > 1:
        print(run(sys.argv[1]))
        return
    print(f"Hugging Face Llama, {LAYERS} layers, hidden 128, 1 x {SEQ_LEN} tokens, 1 process\n\n"
          "| variant | peak MiB allocated in a step | median step ms (steps 3-6) |\n|---|---|---|")
    environment = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, variant], env=environment, capture_output=True, text=True,
                             check=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
