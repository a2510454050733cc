"""Golden text summaries of the ``debug`` model at world size 8 on h100, one per mode.

Any change in the traced schedule or the predictions shows up here as a diff to
review; accept an intended one with ``EXPECTTEST_ACCEPT=1 pytest tests/test_golden_summaries.py``.
"""

import dataclasses

import torch
from expecttest import assert_expected_inline

import simplefsdp
from simplefsdp.ir.hardware import H100, HardwareProfile
from simplefsdp.models.llama import build_model
from simplefsdp.runtime.mixed_precision import MixedPrecision


# h100 with 4 GPUs per node, so that hybrid_shard at world 8 is a (2 nodes, 4 ranks) mesh, not (1, 8).
H100_4_PER_NODE = dataclasses.replace(H100, name="h100-4-per-node", devices_per_node=4)


def debug_summary(mode: str, hardware: HardwareProfile = H100) -> str:
    with torch.device("meta"):
        model = build_model("debug")
    report = simplefsdp.inspect(
        model, (torch.zeros(1, 128, dtype=torch.long),), world_size=8, mode=mode, hardware=hardware,
        mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        title=f"debug, {mode}, world 8, {hardware.name}",
    )
    return report.summary()


def test_fully_shard_summary():
    assert_expected_inline(debug_summary("fully_shard"), """\
debug, fully_shard, world 8, h100
predicted step 1.905 ms: compute 849.0 us, communication 1.056 ms, exposed 1.056 ms, overlap 0.0%, lower bound 1.056 ms
peak memory per rank 915.23 KiB at backward:mul_38: sharded_params 64.16 KiB, unsharded_params 0 B, gradients 20.03 KiB, comm_buffers 0 B, activations 831.05 KiB
FLOPs per rank per step 1.174e+08

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
    assert_expected_inline(debug_summary("replicate"), """\
debug, replicate, world 8, h100
predicted step 1.322 ms: compute 815.3 us, communication 506.5 us, exposed 506.5 us, overlap 0.0%, lower bound 815.3 us
peak memory per rank 1.61 MiB at backward:mul_38: sharded_params 513.25 KiB, unsharded_params 0 B, gradients 160.25 KiB, comm_buffers 0 B, activations 975.17 KiB
FLOPs per rank per step 1.174e+08

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  backward  all_reduce      b0      output                                8  float32     64.00 KiB     24.3 us  no, stalls 24.3 us
  1  backward  all_reduce      b1      norm                                  8  float32         256 B     24.0 us  no, stalls 24.0 us
  2  backward  all_reduce      b2      layers.1.feed_forward.w2              8  float32     48.00 KiB     24.2 us  no, stalls 24.2 us
  3  backward  all_reduce      b3      layers.1.feed_forward.w3              8  float32     48.00 KiB     24.2 us  no, stalls 24.2 us
  4  backward  all_reduce      b4      layers.1.feed_forward.w1              8  float32     48.00 KiB     24.2 us  no, stalls 24.2 us
  5  backward  all_reduce      b5      layers.1.ffn_norm                     8  float32         256 B     24.0 us  no, stalls 24.0 us
  6  backward  all_reduce      b6      layers.1.attention.wo                 8  float32     16.00 KiB     24.1 us  no, stalls 24.1 us
  7  backward  all_reduce      b7      layers.1.attention.wv                 8  float32      8.00 KiB     24.0 us  no, stalls 24.0 us
  8  backward  all_reduce      b8      layers.1.attention.wk                 8  float32      8.00 KiB     24.0 us  no, stalls 24.0 us
  9  backward  all_reduce      b9      layers.1.attention.wq                 8  float32     16.00 KiB     24.1 us  no, stalls 24.1 us
 10  backward  all_reduce      b10     layers.1.attention_norm               8  float32         256 B     24.0 us  no, stalls 24.0 us
 11  backward  all_reduce      b11     layers.0.feed_forward.w2              8  float32     48.00 KiB     24.2 us  no, stalls 24.2 us
 12  backward  all_reduce      b12     layers.0.feed_forward.w3              8  float32     48.00 KiB     24.2 us  no, stalls 24.2 us
 13  backward  all_reduce      b13     layers.0.feed_forward.w1              8  float32     48.00 KiB     24.2 us  no, stalls 24.2 us
 14  backward  all_reduce      b14     layers.0.ffn_norm                     8  float32         256 B     24.0 us  no, stalls 24.0 us
 15  backward  all_reduce      b15     layers.0.attention.wo                 8  float32     16.00 KiB     24.1 us  no, stalls 24.1 us
 16  backward  all_reduce      b16     layers.0.attention.wv                 8  float32      8.00 KiB     24.0 us  no, stalls 24.0 us
 17  backward  all_reduce      b17     layers.0.attention.wk                 8  float32      8.00 KiB     24.0 us  no, stalls 24.0 us
 18  backward  all_reduce      b18     layers.0.attention.wq                 8  float32     16.00 KiB     24.1 us  no, stalls 24.1 us
 19  backward  all_reduce      b19     layers.0.attention_norm               8  float32         256 B     24.0 us  no, stalls 24.0 us
 20  backward  all_reduce      b20     tok_embeddings                        8  float32     64.00 KiB     24.3 us  no, stalls 24.3 us
""")


def test_hybrid_shard_summary():
    assert_expected_inline(debug_summary("hybrid_shard", H100_4_PER_NODE), """\
debug, hybrid_shard, world 8, h100-4-per-node
predicted step 2.046 ms: compute 849.1 us, communication 1.197 ms, exposed 1.197 ms, overlap 0.0%, lower bound 1.197 ms
peak memory per rank 999.42 KiB at backward:mul_38: sharded_params 128.31 KiB, unsharded_params 0 B, gradients 40.06 KiB, comm_buffers 0 B, activations 831.05 KiB
FLOPs per rank per step 1.174e+08

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  forward   all_gather      f0      tok_embeddings                        4  bfloat16    32.00 KiB     13.1 us  no, stalls 13.1 us
  1  forward   all_gather      f1      layers.0.attention_norm               4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
  2  forward   all_gather      f2      layers.0.attention.wq                 4  bfloat16     8.00 KiB     13.0 us  no, stalls 13.0 us
  3  forward   all_gather      f3      layers.0.attention.wk                 4  bfloat16     4.00 KiB     13.0 us  no, stalls 13.0 us
  4  forward   all_gather      f4      layers.0.attention.wv                 4  bfloat16     4.00 KiB     13.0 us  no, stalls 13.0 us
  5  forward   all_gather      f5      layers.0.attention.wo                 4  bfloat16     8.00 KiB     13.0 us  no, stalls 13.0 us
  6  forward   all_gather      f6      layers.0.ffn_norm                     4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
  7  forward   all_gather      f7      layers.0.feed_forward.w1              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
  8  forward   all_gather      f8      layers.0.feed_forward.w3              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
  9  forward   all_gather      f9      layers.0.feed_forward.w2              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 10  forward   all_gather      f10     layers.1.attention_norm               4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
 11  forward   all_gather      f11     layers.1.attention.wq                 4  bfloat16     8.00 KiB     13.0 us  no, stalls 13.0 us
 12  forward   all_gather      f12     layers.1.attention.wk                 4  bfloat16     4.00 KiB     13.0 us  no, stalls 13.0 us
 13  forward   all_gather      f13     layers.1.attention.wv                 4  bfloat16     4.00 KiB     13.0 us  no, stalls 13.0 us
 14  forward   all_gather      f14     layers.1.attention.wo                 4  bfloat16     8.00 KiB     13.0 us  no, stalls 13.0 us
 15  forward   all_gather      f15     layers.1.ffn_norm                     4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
 16  forward   all_gather      f16     layers.1.feed_forward.w1              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 17  forward   all_gather      f17     layers.1.feed_forward.w3              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 18  forward   all_gather      f18     layers.1.feed_forward.w2              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 19  forward   all_gather      f19     norm                                  4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
 20  forward   all_gather      f20     output                                4  bfloat16    32.00 KiB     13.1 us  no, stalls 13.1 us
 21  backward  all_gather      b0      output                                4  bfloat16    32.00 KiB     13.1 us  no, stalls 13.1 us
 22  backward  all_reduce      b1      output                                2  float32     64.00 KiB     19.4 us  no, stalls 19.4 us
 23  backward  reduce_scatter  b2      output                                4  float32     64.00 KiB     13.1 us  no, stalls 13.1 us
 24  backward  all_gather      b3      norm                                  4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
 25  backward  all_reduce      b4      norm                                  2  float32         256 B     18.0 us  no, stalls 18.0 us
 26  backward  reduce_scatter  b5      norm                                  4  float32         256 B     13.0 us  no, stalls 13.0 us
 27  backward  all_gather      b6      layers.1.feed_forward.w2              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 28  backward  all_reduce      b7      layers.1.feed_forward.w2              2  float32     48.00 KiB     19.0 us  no, stalls 19.0 us
 29  backward  reduce_scatter  b8      layers.1.feed_forward.w2              4  float32     48.00 KiB     13.1 us  no, stalls 13.1 us
 30  backward  all_gather      b9      layers.1.feed_forward.w3              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 31  backward  all_reduce      b10     layers.1.feed_forward.w3              2  float32     48.00 KiB     19.0 us  no, stalls 19.0 us
 32  backward  reduce_scatter  b11     layers.1.feed_forward.w3              4  float32     48.00 KiB     13.1 us  no, stalls 13.1 us
 33  backward  all_gather      b12     layers.1.feed_forward.w1              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 34  backward  all_reduce      b13     layers.1.feed_forward.w1              2  float32     48.00 KiB     19.0 us  no, stalls 19.0 us
 35  backward  reduce_scatter  b14     layers.1.feed_forward.w1              4  float32     48.00 KiB     13.1 us  no, stalls 13.1 us
 36  backward  all_gather      b15     layers.1.ffn_norm                     4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
 37  backward  all_reduce      b16     layers.1.ffn_norm                     2  float32         256 B     18.0 us  no, stalls 18.0 us
 38  backward  reduce_scatter  b17     layers.1.ffn_norm                     4  float32         256 B     13.0 us  no, stalls 13.0 us
 39  backward  all_gather      b18     layers.1.attention.wo                 4  bfloat16     8.00 KiB     13.0 us  no, stalls 13.0 us
 40  backward  all_reduce      b19     layers.1.attention.wo                 2  float32     16.00 KiB     18.3 us  no, stalls 18.3 us
 41  backward  reduce_scatter  b20     layers.1.attention.wo                 4  float32     16.00 KiB     13.0 us  no, stalls 13.0 us
 42  backward  all_gather      b21     layers.1.attention.wv                 4  bfloat16     4.00 KiB     13.0 us  no, stalls 13.0 us
 43  backward  all_reduce      b22     layers.1.attention.wv                 2  float32      8.00 KiB     18.2 us  no, stalls 18.2 us
 44  backward  reduce_scatter  b23     layers.1.attention.wv                 4  float32      8.00 KiB     13.0 us  no, stalls 13.0 us
 45  backward  all_gather      b24     layers.1.attention.wk                 4  bfloat16     4.00 KiB     13.0 us  no, stalls 13.0 us
 46  backward  all_reduce      b25     layers.1.attention.wk                 2  float32      8.00 KiB     18.2 us  no, stalls 18.2 us
 47  backward  reduce_scatter  b26     layers.1.attention.wk                 4  float32      8.00 KiB     13.0 us  no, stalls 13.0 us
 48  backward  all_gather      b27     layers.1.attention.wq                 4  bfloat16     8.00 KiB     13.0 us  no, stalls 13.0 us
 49  backward  all_reduce      b28     layers.1.attention.wq                 2  float32     16.00 KiB     18.3 us  no, stalls 18.3 us
 50  backward  reduce_scatter  b29     layers.1.attention.wq                 4  float32     16.00 KiB     13.0 us  no, stalls 13.0 us
 51  backward  all_gather      b30     layers.1.attention_norm               4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
 52  backward  all_reduce      b31     layers.1.attention_norm               2  float32         256 B     18.0 us  no, stalls 18.0 us
 53  backward  reduce_scatter  b32     layers.1.attention_norm               4  float32         256 B     13.0 us  no, stalls 13.0 us
 54  backward  all_gather      b33     layers.0.feed_forward.w2              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 55  backward  all_reduce      b34     layers.0.feed_forward.w2              2  float32     48.00 KiB     19.0 us  no, stalls 19.0 us
 56  backward  reduce_scatter  b35     layers.0.feed_forward.w2              4  float32     48.00 KiB     13.1 us  no, stalls 13.1 us
 57  backward  all_gather      b36     layers.0.feed_forward.w3              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 58  backward  all_reduce      b37     layers.0.feed_forward.w3              2  float32     48.00 KiB     19.0 us  no, stalls 19.0 us
 59  backward  reduce_scatter  b38     layers.0.feed_forward.w3              4  float32     48.00 KiB     13.1 us  no, stalls 13.1 us
 60  backward  all_gather      b39     layers.0.feed_forward.w1              4  bfloat16    24.00 KiB     13.0 us  no, stalls 13.0 us
 61  backward  all_reduce      b40     layers.0.feed_forward.w1              2  float32     48.00 KiB     19.0 us  no, stalls 19.0 us
 62  backward  reduce_scatter  b41     layers.0.feed_forward.w1              4  float32     48.00 KiB     13.1 us  no, stalls 13.1 us
 63  backward  all_gather      b42     layers.0.ffn_norm                     4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
 64  backward  all_reduce      b43     layers.0.ffn_norm                     2  float32         256 B     18.0 us  no, stalls 18.0 us
 65  backward  reduce_scatter  b44     layers.0.ffn_norm                     4  float32         256 B     13.0 us  no, stalls 13.0 us
 66  backward  all_gather      b45     layers.0.attention.wo                 4  bfloat16     8.00 KiB     13.0 us  no, stalls 13.0 us
 67  backward  all_reduce      b46     layers.0.attention.wo                 2  float32     16.00 KiB     18.3 us  no, stalls 18.3 us
 68  backward  reduce_scatter  b47     layers.0.attention.wo                 4  float32     16.00 KiB     13.0 us  no, stalls 13.0 us
 69  backward  all_gather      b48     layers.0.attention.wv                 4  bfloat16     4.00 KiB     13.0 us  no, stalls 13.0 us
 70  backward  all_reduce      b49     layers.0.attention.wv                 2  float32      8.00 KiB     18.2 us  no, stalls 18.2 us
 71  backward  reduce_scatter  b50     layers.0.attention.wv                 4  float32      8.00 KiB     13.0 us  no, stalls 13.0 us
 72  backward  all_gather      b51     layers.0.attention.wk                 4  bfloat16     4.00 KiB     13.0 us  no, stalls 13.0 us
 73  backward  all_reduce      b52     layers.0.attention.wk                 2  float32      8.00 KiB     18.2 us  no, stalls 18.2 us
 74  backward  reduce_scatter  b53     layers.0.attention.wk                 4  float32      8.00 KiB     13.0 us  no, stalls 13.0 us
 75  backward  all_gather      b54     layers.0.attention.wq                 4  bfloat16     8.00 KiB     13.0 us  no, stalls 13.0 us
 76  backward  all_reduce      b55     layers.0.attention.wq                 2  float32     16.00 KiB     18.3 us  no, stalls 18.3 us
 77  backward  reduce_scatter  b56     layers.0.attention.wq                 4  float32     16.00 KiB     13.0 us  no, stalls 13.0 us
 78  backward  all_gather      b57     layers.0.attention_norm               4  bfloat16        128 B     13.0 us  no, stalls 13.0 us
 79  backward  all_reduce      b58     layers.0.attention_norm               2  float32         256 B     18.0 us  no, stalls 18.0 us
 80  backward  reduce_scatter  b59     layers.0.attention_norm               4  float32         256 B     13.0 us  no, stalls 13.0 us
 81  backward  all_reduce      b60     tok_embeddings                        2  float32     64.00 KiB     19.4 us  no, stalls 19.4 us
 82  backward  reduce_scatter  b61     tok_embeddings                        4  float32     64.00 KiB     13.1 us  no, stalls 13.1 us
""")
