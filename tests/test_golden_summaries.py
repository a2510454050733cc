"""Golden text summaries of the ``debug`` model at world size 8 on h100, one per mode, with the default passes.

Each summary pins the per-stage table, the bucket and reorder plans and the
final graphs' collectives; the fully_shard graphs as traced (before any pass)
are pinned on their own. Any change in the traced schedule, the plans or the
predictions shows up here as a diff to review; accept an intended one with
``EXPECTTEST_ACCEPT=1 pytest tests/test_golden_summaries.py``.
"""

import dataclasses

import pytest
import torch
from expecttest import assert_expected_inline

import simplefsdp
from simplefsdp.inspection import InspectReport
from simplefsdp.ir.hardware import H100, HardwareProfile
from simplefsdp.ir.render import text_summary
from simplefsdp.models.llama import build_model
from simplefsdp.runtime.mixed_precision import MixedPrecision


# h100 with 4 GPUs per node, so that hybrid_shard at world 8 is a (2 nodes, 4 ranks) mesh, not (1, 8).
H100_4_PER_NODE = dataclasses.replace(H100, name="h100-4-per-node", devices_per_node=4)


def debug_report(mode: str, hardware: HardwareProfile = H100) -> InspectReport:
    with torch.device("meta"):
        model = build_model("debug")
    report = simplefsdp.inspect(
        model, (torch.zeros(1, 128, dtype=torch.long),), world_size=8, mode=mode, hardware=hardware,
        mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        title=f"debug, {mode}, world 8, {hardware.name}",
    )
    return report


@pytest.fixture(scope="module")
def fully_shard():
    return debug_report("fully_shard")


def test_fully_shard_summary(fully_shard):
    assert_expected_inline(fully_shard.summary(), """\
debug, fully_shard, world 8, h100
stage       collectives  predicted step  exposed comm.  peak memory
traced               62        1.905 ms       1.056 ms   915.23 KiB
bucketed             14        1.044 ms       240.4 us     1.02 MiB
reordered            14        873.8 us        70.0 us     1.12 MiB

bucket plan
forward: 6 bucket(s), 2 block(s) layers.0 .. layers.1
  all_gather tok_embeddings: 1 collective(s) [tok_embeddings]
  all_gather layers.0.attention_norm: 1 collective(s) [layers.0.attention_norm]
  all_gather layers.0.attention: 4 collective(s) [layers.0.attention.wq, layers.0.attention.wk, layers.0.attention.wv, layers.0.attention.wo]
  all_gather layers.0.ffn_norm+layers.0.feed_forward+layers.1.attention_norm+layers.1.attention: 9 collective(s) [layers.0.ffn_norm, layers.0.feed_forward.w1, layers.0.feed_forward.w3, layers.0.feed_forward.w2, layers.1.attention_norm, layers.1.attention.wq, layers.1.attention.wk, layers.1.attention.wv, layers.1.attention.wo]
  all_gather layers.1.ffn_norm+layers.1.feed_forward+norm: 5 collective(s) [layers.1.ffn_norm, layers.1.feed_forward.w1, layers.1.feed_forward.w3, layers.1.feed_forward.w2, norm]
  all_gather output: 1 collective(s) [output]
backward: 8 bucket(s), 2 block(s) layers.0 .. layers.1
  all_gather output: 1 collective(s) [output]
  reduce_scatter tail: 2 collective(s) [output, norm]
  all_gather norm: 1 collective(s) [norm]
  all_gather layers.1.feed_forward+layers.1.ffn_norm+layers.1.attention+layers.1.attention_norm: 9 collective(s) [layers.1.feed_forward.w2, layers.1.feed_forward.w3, layers.1.feed_forward.w1, layers.1.ffn_norm, layers.1.attention.wo, layers.1.attention.wv, layers.1.attention.wk, layers.1.attention.wq, layers.1.attention_norm]
  reduce_scatter layers.1: 9 collective(s) [layers.1.feed_forward.w2, layers.1.feed_forward.w3, layers.1.feed_forward.w1, layers.1.ffn_norm, layers.1.attention.wo, layers.1.attention.wv, layers.1.attention.wk, layers.1.attention.wq, layers.1.attention_norm]
  all_gather layers.0.feed_forward+layers.0.ffn_norm+layers.0.attention+layers.0.attention_norm: 9 collective(s) [layers.0.feed_forward.w2, layers.0.feed_forward.w3, layers.0.feed_forward.w1, layers.0.ffn_norm, layers.0.attention.wo, layers.0.attention.wv, layers.0.attention.wk, layers.0.attention.wq, layers.0.attention_norm]
  reduce_scatter layers.0: 9 collective(s) [layers.0.feed_forward.w2, layers.0.feed_forward.w3, layers.0.feed_forward.w1, layers.0.ffn_norm, layers.0.attention.wo, layers.0.attention.wv, layers.0.attention.wk, layers.0.attention.wq, layers.0.attention_norm]
  reduce_scatter head: 1 collective(s) [tok_embeddings]

reorder plan
forward: 5 prefetch(es), 1 sunk wait(s)
  issue all_gather_into_tensor_1 after wait_tensor (before embedding)
  issue all_gather_into_tensor_out after wait_tensor_1 (before mul_1)
  issue all_gather_into_tensor_out_1 after wait_tensor_21 (before mm)
  issue all_gather_into_tensor_out_2 after wait_tensor_22 (before mul_11)
  issue all_gather_into_tensor_20 after wait_tensor_23 (before mul_24)
  sink wait_tensor_20 to before mm_14
backward: 4 prefetch(es), 3 sunk wait(s)
  issue all_gather_into_tensor_20 after the graph inputs (before mm_15)
  issue all_gather_into_tensor_19 after wait_tensor_20 (before mm_16)
  issue all_gather_into_tensor_out after wait_tensor_19 (before mul_29)
  issue all_gather_into_tensor_out_1 after wait_tensor_42 (before mm_18)
  sink wait_tensor to before reduce_scatter_tensor_22
  sink wait_tensor_43 to before reduce_scatter_tensor_23
  sink wait_tensor_45 to before reduce_scatter_tensor_20

reordered graphs (what runs)
predicted step 873.8 us: compute 803.8 us, communication 240.4 us, exposed 70.0 us, overlap 70.9%, lower bound 803.8 us
peak memory per rank 1.12 MiB at backward:mul_38: sharded_params 64.16 KiB, unsharded_params 96.25 KiB, gradients 8.03 KiB, comm_buffers 0 B, activations 975.30 KiB
FLOPs per rank per step 1.028e+08

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  forward   all_gather      f0      tok_embeddings                        8  bfloat16    32.00 KiB     17.1 us  no, stalls 17.1 us
  1  forward   all_gather      f1      layers.0.attention_norm               8  bfloat16        128 B     17.0 us  no, stalls 0.9 us
  2  forward   all_gather      f2      layers.0.attention.wq                 8  bfloat16    24.00 KiB     17.1 us  no, stalls 15.0 us
  3  forward   all_gather      f3      layers.0.ffn_norm                     8  bfloat16    96.25 KiB     17.2 us  yes
  4  forward   all_gather      f4      layers.1.ffn_norm                     8  bfloat16    72.25 KiB     17.2 us  yes
  5  forward   all_gather      f5      output                                8  bfloat16    32.00 KiB     17.1 us  yes
  6  backward  all_gather      b0      output                                8  bfloat16    32.00 KiB     17.1 us  no, stalls 15.0 us
  7  backward  all_gather      b1      norm                                  8  bfloat16        128 B     17.0 us  no, stalls 4.8 us
  8  backward  all_gather      b2      layers.1.feed_forward.w2              8  bfloat16    96.25 KiB     17.2 us  yes
  9  backward  reduce_scatter  b3      output                                8  float32     64.25 KiB     17.2 us  yes
 10  backward  all_gather      b4      layers.0.feed_forward.w2              8  bfloat16    96.25 KiB     17.2 us  yes
 11  backward  reduce_scatter  b5      layers.1.feed_forward.w2              8  float32    192.50 KiB     17.5 us  yes
 12  backward  reduce_scatter  b6      layers.0.feed_forward.w2              8  float32    192.50 KiB     17.5 us  yes
 13  backward  reduce_scatter  b7      tok_embeddings                        8  float32     64.00 KiB     17.2 us  no, stalls 17.2 us
""")


def test_fully_shard_traced_graphs(fully_shard):
    traced = fully_shard.stage("traced")
    summary = text_summary(fully_shard.title, traced.schedules, traced.prediction, fully_shard.hardware)
    assert_expected_inline(summary, """\
debug, fully_shard, world 8, h100
predicted step 1.905 ms: compute 849.0 us, communication 1.056 ms, exposed 1.056 ms, overlap 0.0%, lower bound 1.056 ms
peak memory per rank 915.23 KiB at backward:mul_38: sharded_params 64.16 KiB, unsharded_params 0 B, gradients 20.03 KiB, comm_buffers 0 B, activations 831.05 KiB
FLOPs per rank per step 1.028e+08

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  forward   all_gather      f0      tok_embeddings                        8  bfloat16    32.00 KiB     17.1 us  no, stalls 17.1 us
  1  forward   all_gather      f1      layers.0.attention_norm               8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
  2  forward   all_gather      f2      layers.0.attention.wq                 8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
  3  forward   all_gather      f3      layers.0.attention.wk                 8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
  4  forward   all_gather      f4      layers.0.attention.wv                 8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
  5  forward   all_gather      f5      layers.0.attention.wo                 8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
  6  forward   all_gather      f6      layers.0.ffn_norm                     8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
  7  forward   all_gather      f7      layers.0.feed_forward.w1              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
  8  forward   all_gather      f8      layers.0.feed_forward.w3              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
  9  forward   all_gather      f9      layers.0.feed_forward.w2              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 10  forward   all_gather      f10     layers.1.attention_norm               8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 11  forward   all_gather      f11     layers.1.attention.wq                 8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 12  forward   all_gather      f12     layers.1.attention.wk                 8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 13  forward   all_gather      f13     layers.1.attention.wv                 8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 14  forward   all_gather      f14     layers.1.attention.wo                 8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 15  forward   all_gather      f15     layers.1.ffn_norm                     8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 16  forward   all_gather      f16     layers.1.feed_forward.w1              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 17  forward   all_gather      f17     layers.1.feed_forward.w3              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 18  forward   all_gather      f18     layers.1.feed_forward.w2              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 19  forward   all_gather      f19     norm                                  8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 20  forward   all_gather      f20     output                                8  bfloat16    32.00 KiB     17.1 us  no, stalls 17.1 us
 21  backward  all_gather      b0      output                                8  bfloat16    32.00 KiB     17.1 us  no, stalls 17.1 us
 22  backward  reduce_scatter  b1      output                                8  float32     64.00 KiB     17.2 us  no, stalls 17.2 us
 23  backward  all_gather      b2      norm                                  8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 24  backward  reduce_scatter  b3      norm                                  8  float32         256 B     17.0 us  no, stalls 17.0 us
 25  backward  all_gather      b4      layers.1.feed_forward.w2              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 26  backward  reduce_scatter  b5      layers.1.feed_forward.w2              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 27  backward  all_gather      b6      layers.1.feed_forward.w3              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 28  backward  reduce_scatter  b7      layers.1.feed_forward.w3              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 29  backward  all_gather      b8      layers.1.feed_forward.w1              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 30  backward  reduce_scatter  b9      layers.1.feed_forward.w1              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 31  backward  all_gather      b10     layers.1.ffn_norm                     8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 32  backward  reduce_scatter  b11     layers.1.ffn_norm                     8  float32         256 B     17.0 us  no, stalls 17.0 us
 33  backward  all_gather      b12     layers.1.attention.wo                 8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 34  backward  reduce_scatter  b13     layers.1.attention.wo                 8  float32     16.00 KiB     17.0 us  no, stalls 17.0 us
 35  backward  all_gather      b14     layers.1.attention.wv                 8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 36  backward  reduce_scatter  b15     layers.1.attention.wv                 8  float32      8.00 KiB     17.0 us  no, stalls 17.0 us
 37  backward  all_gather      b16     layers.1.attention.wk                 8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 38  backward  reduce_scatter  b17     layers.1.attention.wk                 8  float32      8.00 KiB     17.0 us  no, stalls 17.0 us
 39  backward  all_gather      b18     layers.1.attention.wq                 8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 40  backward  reduce_scatter  b19     layers.1.attention.wq                 8  float32     16.00 KiB     17.0 us  no, stalls 17.0 us
 41  backward  all_gather      b20     layers.1.attention_norm               8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 42  backward  reduce_scatter  b21     layers.1.attention_norm               8  float32         256 B     17.0 us  no, stalls 17.0 us
 43  backward  all_gather      b22     layers.0.feed_forward.w2              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 44  backward  reduce_scatter  b23     layers.0.feed_forward.w2              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 45  backward  all_gather      b24     layers.0.feed_forward.w3              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 46  backward  reduce_scatter  b25     layers.0.feed_forward.w3              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 47  backward  all_gather      b26     layers.0.feed_forward.w1              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 48  backward  reduce_scatter  b27     layers.0.feed_forward.w1              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 49  backward  all_gather      b28     layers.0.ffn_norm                     8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 50  backward  reduce_scatter  b29     layers.0.ffn_norm                     8  float32         256 B     17.0 us  no, stalls 17.0 us
 51  backward  all_gather      b30     layers.0.attention.wo                 8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 52  backward  reduce_scatter  b31     layers.0.attention.wo                 8  float32     16.00 KiB     17.0 us  no, stalls 17.0 us
 53  backward  all_gather      b32     layers.0.attention.wv                 8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 54  backward  reduce_scatter  b33     layers.0.attention.wv                 8  float32      8.00 KiB     17.0 us  no, stalls 17.0 us
 55  backward  all_gather      b34     layers.0.attention.wk                 8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 56  backward  reduce_scatter  b35     layers.0.attention.wk                 8  float32      8.00 KiB     17.0 us  no, stalls 17.0 us
 57  backward  all_gather      b36     layers.0.attention.wq                 8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 58  backward  reduce_scatter  b37     layers.0.attention.wq                 8  float32     16.00 KiB     17.0 us  no, stalls 17.0 us
 59  backward  all_gather      b38     layers.0.attention_norm               8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 60  backward  reduce_scatter  b39     layers.0.attention_norm               8  float32         256 B     17.0 us  no, stalls 17.0 us
 61  backward  reduce_scatter  b40     tok_embeddings                        8  float32     64.00 KiB     17.2 us  no, stalls 17.2 us
""")


def test_replicate_summary():
    assert_expected_inline(debug_report("replicate").summary(), """\
debug, replicate, world 8, h100
stage       collectives  predicted step  exposed comm.  peak memory
traced               21        1.322 ms       506.5 us     1.61 MiB
bucketed              2        868.1 us        50.5 us     1.61 MiB
reordered             2        841.9 us        24.3 us     1.61 MiB

bucket plan
forward: 0 bucket(s), 2 block(s) layers.0 .. layers.1
backward: 2 bucket(s), 2 block(s) layers.0 .. layers.1
  all_reduce tail+layers.1+layers.0: 20 collective(s) [output, norm, layers.1.feed_forward.w2, layers.1.feed_forward.w3, layers.1.feed_forward.w1, layers.1.ffn_norm, layers.1.attention.wo, layers.1.attention.wv, layers.1.attention.wk, layers.1.attention.wq, layers.1.attention_norm, layers.0.feed_forward.w2, layers.0.feed_forward.w3, layers.0.feed_forward.w1, layers.0.ffn_norm, layers.0.attention.wo, layers.0.attention.wv, layers.0.attention.wk, layers.0.attention.wq, layers.0.attention_norm]
  all_reduce head: 1 collective(s) [tok_embeddings]

reorder plan
forward: 0 prefetch(es), 0 sunk wait(s)
backward: 0 prefetch(es), 1 sunk wait(s)
  sink wait_tensor_21 to before all_reduce_20

reordered graphs (what runs)
predicted step 841.9 us: compute 817.6 us, communication 50.5 us, exposed 24.3 us, overlap 51.8%, lower bound 817.6 us
peak memory per rank 1.61 MiB at backward:mul_38: sharded_params 513.25 KiB, unsharded_params 0 B, gradients 0 B, comm_buffers 0 B, activations 1.11 MiB
FLOPs per rank per step 1.028e+08

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  backward  all_reduce      b0      output                                8  float32    449.25 KiB     26.2 us  yes
  1  backward  all_reduce      b1      tok_embeddings                        8  float32     64.00 KiB     24.3 us  no, stalls 24.3 us
""")


def test_hybrid_shard_summary():
    assert_expected_inline(debug_report("hybrid_shard", H100_4_PER_NODE).summary(), """\
debug, hybrid_shard, world 8, h100-4-per-node
stage       collectives  predicted step  exposed comm.  peak memory
traced               83        2.038 ms       1.189 ms   999.42 KiB
bucketed             15        1.012 ms       209.9 us     1.09 MiB
reordered            15        914.6 us       112.7 us     1.19 MiB

bucket plan
forward: 5 bucket(s), 2 block(s) layers.0 .. layers.1
  all_gather tok_embeddings: 1 collective(s) [tok_embeddings]
  all_gather layers.0.attention_norm: 1 collective(s) [layers.0.attention_norm]
  all_gather layers.0.attention+layers.0.ffn_norm+layers.0.feed_forward+layers.1.attention_norm: 9 collective(s) [layers.0.attention.wq, layers.0.attention.wk, layers.0.attention.wv, layers.0.attention.wo, layers.0.ffn_norm, layers.0.feed_forward.w1, layers.0.feed_forward.w3, layers.0.feed_forward.w2, layers.1.attention_norm]
  all_gather layers.1.attention+layers.1.ffn_norm+layers.1.feed_forward+norm: 9 collective(s) [layers.1.attention.wq, layers.1.attention.wk, layers.1.attention.wv, layers.1.attention.wo, layers.1.ffn_norm, layers.1.feed_forward.w1, layers.1.feed_forward.w3, layers.1.feed_forward.w2, norm]
  all_gather output: 1 collective(s) [output]
backward: 10 bucket(s), 2 block(s) layers.0 .. layers.1
  all_gather output: 1 collective(s) [output]
  reduce_scatter tail: 2 collective(s) [output, norm]
  all_reduce tail+layers.1+layers.0: 20 collective(s) [output, norm, layers.1.feed_forward.w2, layers.1.feed_forward.w3, layers.1.feed_forward.w1, layers.1.ffn_norm, layers.1.attention.wo, layers.1.attention.wv, layers.1.attention.wk, layers.1.attention.wq, layers.1.attention_norm, layers.0.feed_forward.w2, layers.0.feed_forward.w3, layers.0.feed_forward.w1, layers.0.ffn_norm, layers.0.attention.wo, layers.0.attention.wv, layers.0.attention.wk, layers.0.attention.wq, layers.0.attention_norm]
  all_gather norm: 1 collective(s) [norm]
  all_gather layers.1.feed_forward+layers.1.ffn_norm+layers.1.attention+layers.1.attention_norm: 9 collective(s) [layers.1.feed_forward.w2, layers.1.feed_forward.w3, layers.1.feed_forward.w1, layers.1.ffn_norm, layers.1.attention.wo, layers.1.attention.wv, layers.1.attention.wk, layers.1.attention.wq, layers.1.attention_norm]
  reduce_scatter layers.1: 9 collective(s) [layers.1.feed_forward.w2, layers.1.feed_forward.w3, layers.1.feed_forward.w1, layers.1.ffn_norm, layers.1.attention.wo, layers.1.attention.wv, layers.1.attention.wk, layers.1.attention.wq, layers.1.attention_norm]
  all_gather layers.0.feed_forward+layers.0.ffn_norm+layers.0.attention+layers.0.attention_norm: 9 collective(s) [layers.0.feed_forward.w2, layers.0.feed_forward.w3, layers.0.feed_forward.w1, layers.0.ffn_norm, layers.0.attention.wo, layers.0.attention.wv, layers.0.attention.wk, layers.0.attention.wq, layers.0.attention_norm]
  reduce_scatter layers.0: 9 collective(s) [layers.0.feed_forward.w2, layers.0.feed_forward.w3, layers.0.feed_forward.w1, layers.0.ffn_norm, layers.0.attention.wo, layers.0.attention.wv, layers.0.attention.wk, layers.0.attention.wq, layers.0.attention_norm]
  reduce_scatter head: 1 collective(s) [tok_embeddings]
  all_reduce head: 1 collective(s) [tok_embeddings]

reorder plan
forward: 4 prefetch(es), 1 sunk wait(s)
  issue all_gather_into_tensor_1 after wait_tensor (before embedding)
  issue all_gather_into_tensor_out after wait_tensor_1 (before mul_1)
  issue all_gather_into_tensor_out_1 after wait_tensor_21 (before mm)
  issue all_gather_into_tensor_20 after wait_tensor_22 (before mm_7)
  sink wait_tensor_20 to before mm_14
backward: 4 prefetch(es), 1 sunk wait(s)
  issue all_gather_into_tensor_20 after the graph inputs (before mm_15)
  issue all_gather_into_tensor_19 after wait_tensor_20 (before mm_16)
  issue all_gather_into_tensor_out after wait_tensor_19 (before mul_29)
  issue all_gather_into_tensor_out_1 after wait_tensor_64 (before mm_18)
  sink wait_tensor_63 to before all_reduce_20

reordered graphs (what runs)
predicted step 914.6 us: compute 801.9 us, communication 209.9 us, exposed 112.7 us, overlap 46.3%, lower bound 801.9 us
peak memory per rank 1.19 MiB at backward:mul_38: sharded_params 128.31 KiB, unsharded_params 96.25 KiB, gradients 16.06 KiB, comm_buffers 0 B, activations 975.30 KiB
FLOPs per rank per step 1.028e+08

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  forward   all_gather      f0      tok_embeddings                        4  bfloat16    32.00 KiB     13.1 us  no, stalls 13.1 us
  1  forward   all_gather      f1      layers.0.attention_norm               4  bfloat16        128 B     13.0 us  yes
  2  forward   all_gather      f2      layers.0.attention.wq                 4  bfloat16    96.25 KiB     13.2 us  no, stalls 11.2 us
  3  forward   all_gather      f3      layers.1.attention.wq                 4  bfloat16    96.25 KiB     13.2 us  yes
  4  forward   all_gather      f4      output                                4  bfloat16    32.00 KiB     13.1 us  yes
  5  backward  all_gather      b0      output                                4  bfloat16    32.00 KiB     13.1 us  no, stalls 11.0 us
  6  backward  all_gather      b1      norm                                  4  bfloat16        128 B     13.0 us  no, stalls 0.8 us
  7  backward  all_gather      b2      layers.1.feed_forward.w2              4  bfloat16    96.25 KiB     13.2 us  yes
  8  backward  reduce_scatter  b3      output                                4  float32     64.25 KiB     13.1 us  no, stalls 18.3 us
  9  backward  all_gather      b4      layers.0.feed_forward.w2              4  bfloat16    96.25 KiB     13.2 us  yes
 10  backward  reduce_scatter  b5      layers.1.feed_forward.w2              4  float32    192.50 KiB     13.4 us  no, stalls 13.4 us
 11  backward  reduce_scatter  b6      layers.0.feed_forward.w2              4  float32    192.50 KiB     13.4 us  no, stalls 13.4 us
 12  backward  all_reduce      b7      output                                2  float32    112.31 KiB     20.4 us  yes
 13  backward  reduce_scatter  b8      tok_embeddings                        4  float32     64.00 KiB     13.1 us  no, stalls 13.1 us
 14  backward  all_reduce      b9      tok_embeddings                        2  float32     16.00 KiB     18.3 us  no, stalls 18.3 us
""")
