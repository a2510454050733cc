"""``simplefsdp.inspect`` and ``simplefsdp inspect``: trace a sharded model in one process and predict its step.

The model is copied onto the meta device, its parameters sharded over a fake
process group of the requested world size, and one forward and backward traced
(see ``simplefsdp.ir.capture``). Nothing is allocated for the parameters, so
Llama 3 8B on 512 ranks fits on a laptop.
"""

from __future__ import annotations

import argparse
import copy
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from simplefsdp.ir.capture import capture_graphs
from simplefsdp.ir.cost_model import as_number
from simplefsdp.ir.hardware import PROFILE_NAMES, HardwareProfile, get_profile
from simplefsdp.ir.render import chrome_trace, svg_timeline, text_summary
from simplefsdp.ir.schedule import Schedule, read_schedule
from simplefsdp.ir.simulator import Prediction, simulate
from simplefsdp.models.llama import CONFIGS, build_model, get_config
from simplefsdp.runtime.fake_world import fake_world
from simplefsdp.runtime.mesh import MESH_DIM_NAMES, MODES
from simplefsdp.runtime.mixed_precision import MixedPrecision
from simplefsdp.runtime.replicate_compute import ReplicateComputation
from simplefsdp.runtime.sharding import shard_parameters


@dataclass
class InspectReport:
    """The traced graphs of one step, their schedules and the predictions; ``save`` writes them all."""

    title: str
    forward: Schedule
    backward: Schedule
    prediction: Prediction
    hardware: HardwareProfile

    @property
    def schedules(self) -> list[Schedule]:
        return [self.forward, self.backward]

    @property
    def sharded_param_bytes(self) -> int:
        """Bytes of parameter shards one rank holds."""
        return int(sum(as_number(graph_input.bytes) for graph_input in self.forward.inputs if graph_input.param_fqn))

    @property
    def flops(self) -> float:
        """FLOPs one rank runs in a step (forward and backward)."""
        return sum(as_number(node.flops) for schedule in self.schedules for node in schedule.nodes)

    def summary(self) -> str:
        """The text summary: predictions, then one row per collective."""
        return text_summary(self.title, self.schedules, self.prediction, self.hardware)

    def save(self, directory: str | Path) -> list[Path]:
        """Write forward.py, backward.py (FX code), summary.txt, timeline.svg and trace.json; return their paths."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        contents = {
            "forward.py": self.forward.code,
            "backward.py": self.backward.code,
            "summary.txt": self.summary(),
            "timeline.svg": svg_timeline(self.title, self.schedules, self.prediction, self.hardware),
            "trace.json": chrome_trace(self.schedules, self.prediction, self.hardware),
        }
        for name, text in contents.items():
            (folder / name).write_text(text)
        return [folder / name for name in contents]


def inspect(
    model: nn.Module,
    example_inputs: tuple,
    *,
    world_size: int | None = None,
    mode: str = "fully_shard",
    hardware: str | HardwareProfile = "h100",
    mp_policy: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    title: str | None = None,
) -> InspectReport:
    """Trace ``model`` as ``compile_sharded`` would shard it on ``world_size`` ranks and predict one step.

    Runs in this process on a fake process group (``world_size`` defaults to 1)
    with meta-device copies of the model and inputs; ``model`` itself is not
    changed. ``hardware`` is a profile name (``h100``, ``a100``, ``cpu``), a JSON
    path or a ``HardwareProfile``. Each bad argument raises one clear error.
    """
    profile = get_profile(hardware)
    world_size = 1 if world_size is None else world_size
    mesh_shape = _mesh_shape(mode, world_size, profile.devices_per_node)
    mp_policy = mp_policy or MixedPrecision()
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(
                f"parameter {name!r} is already sharded; pass inspect the model before compile_sharded"
            )
    meta_model = _meta_copy(model)
    meta_inputs = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
    with fake_world(world_size):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=MESH_DIM_NAMES[mode])
        replicate = ReplicateComputation(
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
            reshard_after_forward=reshard_after_forward and mode != "replicate",
        )
        shard_parameters(meta_model, mesh, mode, replicate)
        graphs = capture_graphs(meta_model, meta_inputs)
        forward = read_schedule(graphs.forward, "forward", graphs.param_fqns)
        backward = read_schedule(graphs.backward, "backward", graphs.param_fqns)
    compute_dtype = mp_policy.param_dtype or next(model.parameters()).dtype
    prediction = simulate(forward, backward, profile, compute_dtype)
    title = title or (
        f"{type(model).__name__}, {mode}, world {world_size} (mesh {tuple(mesh_shape)}), hardware {profile.name}"
    )
    return InspectReport(title, forward, backward, prediction, profile)


def _mesh_shape(mode: str, world_size: int, devices_per_node: int) -> tuple[int, ...]:
    """The mesh ``mode`` uses on ``world_size`` ranks: 1-D, or (nodes, ranks per node) for hybrid_shard."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}; pass e.g. world_size=8")
    if mode != "hybrid_shard":
        return (world_size,)
    per_node = min(devices_per_node, world_size)
    if world_size % per_node:
        raise ValueError(
            f"world size {world_size} does not fit the hybrid_shard mesh (nodes, {per_node} ranks per node); "
            f"pass a multiple of {per_node}, or a hardware profile whose devices_per_node divides it"
        )
    return (world_size // per_node, per_node)


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers live on the meta device (nothing allocated)."""
    memo = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simplefsdp.cli import dtype_arg

    parser.add_argument("--model", default="llama3-8b", choices=sorted(CONFIGS))
    parser.add_argument("--world-size", type=int, default=8, help="ranks to shard over (traced in this process)")
    parser.add_argument("--hardware", default="h100", help=f"{', '.join(PROFILE_NAMES)}, or a profile JSON path")
    parser.add_argument("--mode", default="fully_shard", choices=MODES)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's maximum)")
    parser.add_argument("--param-dtype", type=dtype_arg, default=torch.bfloat16, help="compute dtype (bfloat16)")
    parser.add_argument("--reduce-dtype", type=dtype_arg, default=torch.float32, help="gradient reduction dtype (float32)")
    parser.add_argument("--no-reshard", dest="reshard_after_forward", action="store_false",
                        help="keep gathered parameters from forward to backward")
    parser.add_argument("--out", default=None, help="folder for the graphs, summary, timeline.svg and trace.json")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Trace the named model on the meta device, print the summary, write the files to ``--out``."""
    config = get_config(args.model)
    seq_len = args.seq_len or config.max_seq_len
    if args.batch_size < 1 or not 1 <= seq_len <= config.max_seq_len:
        raise SystemExit(
            f"simplefsdp inspect: --batch-size must be at least 1 and --seq-len between 1 and "
            f"{config.max_seq_len} (the maximum of {args.model})"
        )
    with torch.device("meta"):
        model = build_model(args.model)
    tokens = torch.zeros(args.batch_size, seq_len, dtype=torch.long, device="meta")
    title = (
        f"{args.model}, {args.mode}, world {args.world_size}, hardware {args.hardware}, "
        f"{args.batch_size}x{seq_len} tokens per rank, params {str(args.param_dtype).removeprefix('torch.')}"
    )
    try:
        report = inspect(
            model, (tokens,), world_size=args.world_size, mode=args.mode, hardware=args.hardware,
            mp_policy=MixedPrecision(args.param_dtype, args.reduce_dtype),
            reshard_after_forward=args.reshard_after_forward, title=title,
        )
    except ValueError as error:
        raise SystemExit(f"simplefsdp inspect: {error}") from None
    print(report.summary(), end="")
    if args.out:
        for path in report.save(args.out):
            print(f"wrote {path}")
    return 0
