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
from simplefsdp.inspect_report import InspectReport
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
traced               51        1.698 ms       869.1 us   880.08 KiB
bucketed              9        948.8 us       155.1 us   896.45 KiB
reordered             9        843.2 us        49.4 us     1.02 MiB

bucket plan
forward: 4 bucket(s), 2 block(s) layers.0 .. layers.1
  all_gather tok_embeddings: 1 collective(s) [tok_embeddings]
  all_gather layers.0: 9 collective(s) [layers.0]
  all_gather layers.1: 9 collective(s) [layers.1]
  all_gather norm+output: 2 collective(s) [norm, output]
backward: 5 bucket(s), 2 block(s) layers.0 .. layers.1
  reduce_scatter output+norm: 2 collective(s) [output, norm]
  reduce_scatter layers.1: 9 collective(s) [layers.1]
  all_gather layers.0: 9 collective(s) [layers.0]
  reduce_scatter layers.0: 9 collective(s) [layers.0]
  reduce_scatter tok_embeddings: 1 collective(s) [tok_embeddings]

reorder plan
forward: 3 prefetch(es), 0 sunk wait(s)
  issue all_gather_into_tensor_out after wait_tensor (before embedding)
  issue all_gather_into_tensor_out_1 after all_gather_copy_out (before invoke_subgraph_4)
  issue all_gather_into_tensor_out_2 after all_gather_copy_out_1 (before invoke_subgraph_6)
backward: 1 prefetch(es), 3 sunk wait(s)
  issue all_gather_into_tensor_out after the graph inputs (before mm_1)
  sink wait_tensor to before reduce_scatter_tensor_22
  sink wait_tensor_42 to before reduce_scatter_tensor_23
  sink wait_tensor_44 to before reduce_scatter_tensor_20

reordered graphs (what runs)
predicted step 843.2 us: compute 793.7 us, communication 155.1 us, exposed 49.4 us, overlap 68.1%, lower bound 793.7 us
peak memory per rank 1.02 MiB at backward:all_gather_into_tensor_out: sharded_params 64.16 KiB, unsharded_params 96.25 KiB, gradients 0 B, comm_buffers 0 B, activations 880.17 KiB
FLOPs per rank per step 1.028e+08
forward region partitioned_fw_subgraph_0_0 (in forward.py): the compute of 2 block(s), layers.0 to layers.1
backward region partitioned_bw_subgraph_0_0 (in backward.py): the compute of 2 block(s), layers.1 to layers.0

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  forward   all_gather      f0      tok_embeddings                        8  bfloat16    32.00 KiB     17.1 us  no, stalls 17.1 us
  1  forward   all_gather      f1      layers.0                              8  bfloat16    96.25 KiB     17.2 us  no, stalls 15.2 us
  2  forward   all_gather      f2      layers.1                              8  bfloat16    96.25 KiB     17.2 us  yes
  3  forward   all_gather      f3      norm                                  8  bfloat16    32.12 KiB     17.1 us  yes
  4  backward  all_gather      b0      layers.0                              8  bfloat16    96.25 KiB     17.2 us  yes
  5  backward  reduce_scatter  b1      output                                8  float32     64.25 KiB     17.2 us  yes
  6  backward  reduce_scatter  b2      layers.1                              8  float32    192.50 KiB     17.5 us  yes
  7  backward  reduce_scatter  b3      layers.0                              8  float32    192.50 KiB     17.5 us  yes
  8  backward  reduce_scatter  b4      tok_embeddings                        8  float32     64.00 KiB     17.2 us  no, stalls 17.2 us
""")


def test_fully_shard_traced_graphs(fully_shard):
    traced = fully_shard.stage("traced")
    summary = text_summary(fully_shard.title, traced.schedules, traced.prediction, fully_shard.hardware)
    assert_expected_inline(summary, """\
debug, fully_shard, world 8, h100
predicted step 1.698 ms: compute 829.0 us, communication 869.1 us, exposed 869.1 us, overlap 0.0%, lower bound 869.1 us
peak memory per rank 880.08 KiB at backward:mm_1: sharded_params 64.16 KiB, unsharded_params 128.38 KiB, gradients 0 B, comm_buffers 0 B, activations 687.55 KiB
FLOPs per rank per step 1.028e+08
forward region partitioned_fw_subgraph_0_0 (in forward.py): the compute of 2 block(s), layers.0 to layers.1
backward region partitioned_bw_subgraph_0_0 (in backward.py): the compute of 2 block(s), layers.1 to layers.0

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  forward   all_gather      f0      tok_embeddings                        8  bfloat16    32.00 KiB     17.1 us  no, stalls 17.1 us
  1  forward   all_gather      f1      layers.0                              8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
  2  forward   all_gather      f2      layers.0                              8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
  3  forward   all_gather      f3      layers.0                              8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
  4  forward   all_gather      f4      layers.0                              8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
  5  forward   all_gather      f5      layers.0                              8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
  6  forward   all_gather      f6      layers.0                              8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
  7  forward   all_gather      f7      layers.0                              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
  8  forward   all_gather      f8      layers.0                              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
  9  forward   all_gather      f9      layers.0                              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 10  forward   all_gather      f10     layers.1                              8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 11  forward   all_gather      f11     layers.1                              8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 12  forward   all_gather      f12     layers.1                              8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 13  forward   all_gather      f13     layers.1                              8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 14  forward   all_gather      f14     layers.1                              8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 15  forward   all_gather      f15     layers.1                              8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 16  forward   all_gather      f16     layers.1                              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 17  forward   all_gather      f17     layers.1                              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 18  forward   all_gather      f18     layers.1                              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 19  forward   all_gather      f19     norm                                  8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 20  forward   all_gather      f20     output                                8  bfloat16    32.00 KiB     17.1 us  no, stalls 17.1 us
 21  backward  reduce_scatter  b0      output                                8  float32     64.00 KiB     17.2 us  no, stalls 17.2 us
 22  backward  reduce_scatter  b1      norm                                  8  float32         256 B     17.0 us  no, stalls 17.0 us
 23  backward  reduce_scatter  b2      layers.1                              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 24  backward  reduce_scatter  b3      layers.1                              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 25  backward  reduce_scatter  b4      layers.1                              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 26  backward  reduce_scatter  b5      layers.1                              8  float32         256 B     17.0 us  no, stalls 17.0 us
 27  backward  reduce_scatter  b6      layers.1                              8  float32     16.00 KiB     17.0 us  no, stalls 17.0 us
 28  backward  reduce_scatter  b7      layers.1                              8  float32      8.00 KiB     17.0 us  no, stalls 17.0 us
 29  backward  reduce_scatter  b8      layers.1                              8  float32      8.00 KiB     17.0 us  no, stalls 17.0 us
 30  backward  reduce_scatter  b9      layers.1                              8  float32     16.00 KiB     17.0 us  no, stalls 17.0 us
 31  backward  reduce_scatter  b10     layers.1                              8  float32         256 B     17.0 us  no, stalls 17.0 us
 32  backward  all_gather      b11     layers.0                              8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 33  backward  all_gather      b12     layers.0                              8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 34  backward  all_gather      b13     layers.0                              8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 35  backward  all_gather      b14     layers.0                              8  bfloat16     4.00 KiB     17.0 us  no, stalls 17.0 us
 36  backward  all_gather      b15     layers.0                              8  bfloat16     8.00 KiB     17.0 us  no, stalls 17.0 us
 37  backward  all_gather      b16     layers.0                              8  bfloat16        128 B     17.0 us  no, stalls 17.0 us
 38  backward  all_gather      b17     layers.0                              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 39  backward  all_gather      b18     layers.0                              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 40  backward  all_gather      b19     layers.0                              8  bfloat16    24.00 KiB     17.1 us  no, stalls 17.1 us
 41  backward  reduce_scatter  b20     layers.0                              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 42  backward  reduce_scatter  b21     layers.0                              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 43  backward  reduce_scatter  b22     layers.0                              8  float32     48.00 KiB     17.1 us  no, stalls 17.1 us
 44  backward  reduce_scatter  b23     layers.0                              8  float32         256 B     17.0 us  no, stalls 17.0 us
 45  backward  reduce_scatter  b24     layers.0                              8  float32     16.00 KiB     17.0 us  no, stalls 17.0 us
 46  backward  reduce_scatter  b25     layers.0                              8  float32      8.00 KiB     17.0 us  no, stalls 17.0 us
 47  backward  reduce_scatter  b26     layers.0                              8  float32      8.00 KiB     17.0 us  no, stalls 17.0 us
 48  backward  reduce_scatter  b27     layers.0                              8  float32     16.00 KiB     17.0 us  no, stalls 17.0 us
 49  backward  reduce_scatter  b28     layers.0                              8  float32         256 B     17.0 us  no, stalls 17.0 us
 50  backward  reduce_scatter  b29     tok_embeddings                        8  float32     64.00 KiB     17.2 us  no, stalls 17.2 us
""")


def test_replicate_summary():
    assert_expected_inline(debug_report("replicate").summary(), """\
debug, replicate, world 8, h100
stage       collectives  predicted step  exposed comm.  peak memory
traced               21        1.318 ms       506.5 us     1.42 MiB
bucketed              3        890.1 us        74.5 us     1.42 MiB
reordered             3        844.7 us        29.1 us     1.42 MiB

bucket plan
forward: 0 bucket(s), 2 block(s) layers.0 .. layers.1
backward: 3 bucket(s), 2 block(s) layers.0 .. layers.1
  all_reduce output+norm+layers.1: 11 collective(s) [output, norm, layers.1]
  all_reduce layers.0: 9 collective(s) [layers.0]
  all_reduce tok_embeddings: 1 collective(s) [tok_embeddings]

reorder plan
forward: 0 prefetch(es), 0 sunk wait(s)
backward: 0 prefetch(es), 2 sunk wait(s)
  sink wait_tensor_21 to before all_reduce_22
  sink wait_tensor_22 to before all_reduce_20

reordered graphs (what runs)
predicted step 844.7 us: compute 815.6 us, communication 74.5 us, exposed 29.1 us, overlap 61.0%, lower bound 815.6 us
peak memory per rank 1.42 MiB at backward:mul_5: sharded_params 513.25 KiB, unsharded_params 0 B, gradients 0 B, comm_buffers 0 B, activations 944.30 KiB
FLOPs per rank per step 1.028e+08
forward region partitioned_fw_subgraph_1_0 (in forward.py): the compute of 2 block(s), layers.0 to layers.1
backward region partitioned_bw_subgraph_1_0 (in backward.py): the compute of 2 block(s), layers.1 to layers.0

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  backward  all_reduce      b0      output                                8  float32    256.75 KiB     25.2 us  yes
  1  backward  all_reduce      b1      layers.0                              8  float32    192.50 KiB     24.9 us  no, stalls 4.8 us
  2  backward  all_reduce      b2      tok_embeddings                        8  float32     64.00 KiB     24.3 us  no, stalls 24.3 us
""")


def test_hybrid_shard_summary():
    assert_expected_inline(debug_report("hybrid_shard", H100_4_PER_NODE).summary(), """\
debug, hybrid_shard, world 8, h100-4-per-node
stage       collectives  predicted step  exposed comm.  peak memory
traced               72        1.875 ms       1.046 ms   944.23 KiB
bucketed             12        973.4 us       175.6 us   960.61 KiB
reordered            12        893.5 us        95.7 us     1.08 MiB

bucket plan
forward: 4 bucket(s), 2 block(s) layers.0 .. layers.1
  all_gather tok_embeddings: 1 collective(s) [tok_embeddings]
  all_gather layers.0: 9 collective(s) [layers.0]
  all_gather layers.1: 9 collective(s) [layers.1]
  all_gather norm+output: 2 collective(s) [norm, output]
backward: 8 bucket(s), 2 block(s) layers.0 .. layers.1
  reduce_scatter output+norm: 2 collective(s) [output, norm]
  all_reduce output+norm+layers.1: 11 collective(s) [output, norm, layers.1]
  reduce_scatter layers.1: 9 collective(s) [layers.1]
  all_gather layers.0: 9 collective(s) [layers.0]
  reduce_scatter layers.0: 9 collective(s) [layers.0]
  all_reduce layers.0: 9 collective(s) [layers.0]
  reduce_scatter tok_embeddings: 1 collective(s) [tok_embeddings]
  all_reduce tok_embeddings: 1 collective(s) [tok_embeddings]

reorder plan
forward: 3 prefetch(es), 0 sunk wait(s)
  issue all_gather_into_tensor_out after wait_tensor (before embedding)
  issue all_gather_into_tensor_out_1 after all_gather_copy_out (before invoke_subgraph_4)
  issue all_gather_into_tensor_out_2 after all_gather_copy_out_1 (before invoke_subgraph_6)
backward: 1 prefetch(es), 2 sunk wait(s)
  issue all_gather_into_tensor_out after the graph inputs (before mm_1)
  sink wait_tensor_63 to before all_reduce_22
  sink wait_tensor_67 to before all_reduce_20

reordered graphs (what runs)
predicted step 893.5 us: compute 797.8 us, communication 175.6 us, exposed 95.7 us, overlap 45.5%, lower bound 797.8 us
peak memory per rank 1.08 MiB at backward:all_gather_into_tensor_out: sharded_params 128.31 KiB, unsharded_params 96.25 KiB, gradients 0 B, comm_buffers 0 B, activations 880.17 KiB
FLOPs per rank per step 1.028e+08
forward region partitioned_fw_subgraph_0_0 (in forward.py): the compute of 2 block(s), layers.0 to layers.1
backward region partitioned_bw_subgraph_0_0 (in backward.py): the compute of 2 block(s), layers.1 to layers.0

  #  phase     kind            bucket  module                            group  dtype           bytes        time  hidden
  0  forward   all_gather      f0      tok_embeddings                        4  bfloat16    32.00 KiB     13.1 us  no, stalls 13.1 us
  1  forward   all_gather      f1      layers.0                              4  bfloat16    96.25 KiB     13.2 us  no, stalls 11.2 us
  2  forward   all_gather      f2      layers.1                              4  bfloat16    96.25 KiB     13.2 us  yes
  3  forward   all_gather      f3      norm                                  4  bfloat16    32.12 KiB     13.1 us  yes
  4  backward  all_gather      b0      layers.0                              4  bfloat16    96.25 KiB     13.2 us  yes
  5  backward  reduce_scatter  b1      output                                4  float32     64.25 KiB     13.1 us  no, stalls 13.1 us
  6  backward  reduce_scatter  b2      layers.1                              4  float32    192.50 KiB     13.4 us  no, stalls 13.4 us
  7  backward  all_reduce      b3      output                                2  float32     64.19 KiB     19.4 us  yes
  8  backward  reduce_scatter  b4      layers.0                              4  float32    192.50 KiB     13.4 us  no, stalls 13.4 us
  9  backward  all_reduce      b5      layers.0                              2  float32     48.12 KiB     19.0 us  yes
 10  backward  reduce_scatter  b6      tok_embeddings                        4  float32     64.00 KiB     13.1 us  no, stalls 13.1 us
 11  backward  all_reduce      b7      tok_embeddings                        2  float32     16.00 KiB     18.3 us  no, stalls 18.3 us
""")
