"""What a gloo all-gather costs by size and by form, on the ranks of one machine (issue 64's next levers).

    torchrun --nproc-per-node 2 benchmarks/gloo_collective_sizes.py

Per shard size, the median wall and process CPU time (gloo's threads included) of one functional all-gather, of the
same bytes as an all-to-all of the shard repeated once per rank, and of the shard all-gathered in 4 and 16 chunks
issued together and then waited (and in 16 chunks reassembled into one rank-major buffer, as a parameter needs it);
then as our graphs gather (into a buffer whose rank's slice holds the shard, ``all_gather_into_tensor_out``) beside
one in-place broadcast of each rank's slice of that buffer, all issued, then waited (gloo copies no flat buffer for
a broadcast, and runs the broadcasts on its threads side by side). Medians of 15 calls, each after a barrier; printed
by rank 0.
"""

import statistics
import time

import torch
import torch.distributed as dist

CALLS = 15


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, name = dist.get_world_size(), dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional

    def all_gather(shard: torch.Tensor, chunks: int = 1, reassemble: bool = False) -> None:
        works = [ops.all_gather_into_tensor(piece, world, name) for piece in shard.chunk(chunks)]
        gathered = [ops.wait_tensor(work) for work in works]
        if reassemble:
            torch.cat([part.view(world, -1) for part in gathered], dim=1)

    def all_to_all(shard: torch.Tensor) -> None:
        splits = [shard.numel()] * world
        ops.wait_tensor(ops.all_to_all_single(shard.repeat(world), splits, splits, name))

    def into_buffer(shard: torch.Tensor, broadcasts: bool) -> None:
        buffer = torch.empty(world * shard.numel())
        slices = buffer.chunk(world)
        slices[dist.get_rank()].copy_(shard)
        if broadcasts:
            for work in [ops.broadcast_(piece, rank, name) for rank, piece in enumerate(slices)]:
                ops.wait_tensor(work)
        else:
            ops.wait_tensor(ops.all_gather_into_tensor_out(slices[dist.get_rank()], world, name, out=buffer))

    forms = {"all-gather": all_gather, "all-to-all": all_to_all, "all-gather, 4 chunks": lambda s: all_gather(s, 4),
             "all-gather, 16 chunks": lambda s: all_gather(s, 16),
             "all-gather, 16 chunks, reassembled": lambda s: all_gather(s, 16, reassemble=True),
             "all-gather into a buffer": lambda s: into_buffer(s, broadcasts=False),
             "broadcasts into a buffer": lambda s: into_buffer(s, broadcasts=True)}
    if dist.get_rank() == 0:
        print("| shard MiB | form | wall ms | CPU ms |\n|---|---|---|---|")
    for mib in (0.25, 1, 4, 16, 64):
        shard = torch.randn(int(mib * 2**20) // 4)
        for form, run in forms.items():
            walls, cpus = [], []
            for _ in range(CALLS):
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                run(shard)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            if dist.get_rank() == 0:
                print(f"| {mib} | {form} | {1e3 * statistics.median(walls):.2f} | {1e3 * statistics.median(cpus):.2f} |",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
