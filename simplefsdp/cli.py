"""The ``simplefsdp`` command line: ``train``, ``inspect`` and ``bench``, each option shared by several defined once;
built from ``simplefsdp.names`` so that ``--help`` imports no torch (ARCHITECTURE.md)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from simplefsdp.names import (AC_MODES, CONTENDER_NAMES, DEFAULT_LR, DEVICES, DTYPE_NAMES, MODEL_NAMES, MODES,
                              PROFILE_NAMES, SYNC_MODES)

BUCKETS = {"auto": "auto", "block": "block", "none": None}
DTYPES = {name: name for name in DTYPE_NAMES}  # parsed to names: the command modules turn them into torch dtypes
MODEL_HELP = (f"a reference model ({', '.join(MODEL_NAMES)}), hf:PATH (a Hugging Face config.json or model folder), "
              "or package.module:function (your own model; see docs/your-model.md)")


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help but not a flag's, nor a None one (whose help says it in words)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)


def _choice(table: dict, what: str):
    """An argparse type that maps a name to its value in ``table``, naming the choices for any other name."""
    def parse(name: str):
        if name not in table:
            raise argparse.ArgumentTypeError(f"unknown {what} {name!r}; choose one of: {', '.join(table)}")
        return table[name]
    return parse


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def contenders_arg(text: str) -> list[str]:
    """Parse ``--only NAME[,NAME]``, rejecting unknown names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONTENDER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown contender(s) {', '.join(unknown) or '(none given)'}; choose from: {', '.join(CONTENDER_NAMES)}")
    return names


def _groups(parser: argparse.ArgumentParser, *titles: str) -> dict:
    """A command's option groups by title, in the order its help lists them."""
    return {title: parser.add_argument_group(title) for title in titles}


def _workload(groups: dict, model: str, batch_size: int, seq_len: int | None, dtypes: tuple) -> None:
    """--model, --layers, --batch-size, --seq-len, the dtypes and the low-bit formats, with one command's defaults."""
    group = groups["model and data"]
    group.add_argument("--model", default=model, help=MODEL_HELP)
    group.add_argument("--layers", type=_at_least_one, default=None, metavar="N",
                       help="transformer blocks (default: the named model's count)")
    group.add_argument("--batch-size", type=int, default=batch_size, metavar="N", help="sequences per rank per step")
    group.add_argument("--seq-len", type=int, default=seq_len, metavar="N",
                       help="tokens per sequence" + ("" if seq_len else " (default: the model's maximum)"))
    group = groups["sharding"]
    for option, default, use in zip(("--param-dtype", "--reduce-dtype"), dtypes, ("gather and compute", "gradient")):
        group.add_argument(option, type=_choice(DTYPES, "dtype"), default=default, metavar="{" + ",".join(DTYPES) + "}",
                           help=f"{use} dtype" + ("" if default else " (default: the parameter's own)"))
    group.add_argument("--quantize-gather", choices=["int8"],
                       help="send weight all-gathers in this format (default: in the gather dtype)")
    group.add_argument("--quantize-reduce", choices=["int8", "int4"],
                       help="exchange gradients in this format, with error feedback (default: in the gradient dtype)")
    group.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                       help="with --quantize-reduce: no error feedback buffers")
    group.add_argument("--quantize-block-size", type=int, default=256, metavar="N",
                       help="values per fp32 scale in the low-bit formats")


def _sharding(groups: dict) -> None:
    """The layout (--mode, --tp, --no-reshard) and what compiles it: activation checkpointing and the passes."""
    group = groups["sharding"]
    group.add_argument("--mode", default="fully_shard", choices=MODES,
                       help="shard parameters over all ranks (fully_shard), keep a whole copy on each (replicate), "
                            "or shard within groups and replicate across them (hybrid_shard)")
    group.add_argument("--tp", type=int, default=1, metavar="N",
                       help="tensor-parallel degree: mesh (ranks // tp, tp), fully_shard over dp, Megatron TP")
    group.add_argument("--no-reshard", dest="reshard_after_forward", action="store_false",
                       help="keep gathered parameters from forward to backward")
    group = groups["compile and passes"]
    group.add_argument("--activation-checkpointing", default="none", choices=AC_MODES,
                       help="recompute each transformer block in backward: all of it (full), or all but its matmuls "
                            "and attention (selective)")
    group.add_argument("--buckets", type=_choice(BUCKETS, "bucket mode"), default="auto", metavar="{auto,block,none}",
                       help="bucketing of the collectives (none: one collective per parameter)")
    group.add_argument("--no-reorder", dest="reorder", action="store_false",
                       help="keep the traced order of the collectives (no prefetching, no sunk waits)")
    blocks_once = group.add_mutually_exclusive_group()
    blocks_once.add_argument("--compile-blocks-once", action="store_const", const=True, default=None,
                             help="compile each distinct block's compute once for all its repeats, and refuse a "
                                  "model it cannot run (default: on where it can, so not with --tp or --dynamic)")
    blocks_once.add_argument("--whole-graph", dest="compile_blocks_once", action="store_const", const=False,
                             help="trace and compile every block on its own (compile_blocks_once=False)")
    group.add_argument("--prefetch", type=int, default=1, metavar="N", help="all-gather buckets issued ahead")
    group.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                       help="gathered parameter bytes in flight that --buckets auto may use (default: no limit)")


def _accumulation(groups: dict) -> None:
    """Gradient accumulation: micro-batches per step, and after which of them gradients are reduced."""
    groups["optimizer"].add_argument("--grad-accum", type=int, default=1, metavar="N",
                                     help="micro-batches per optimizer step")
    groups["sharding"].add_argument(
        "--grad-accum-reduce", choices=("every", "last"), default=None, help="simplefsdp reduces gradients after "
        "every micro-batch (sharded gradients accumulate: ZeRO-3 memory) or only the last (full local gradients "
        "accumulate, one reduction) (default: every for fully_shard, last for replicate and hybrid_shard)")


def _local_ranks(groups: dict, optimizers: tuple[str, ...]) -> None:
    """What a command that runs ranks shares: their number, seed, learning rate and compiler backend."""
    groups["sharding"].add_argument("--nproc", type=int, default=2, metavar="N",
                                    help="local ranks to launch (ignored under torchrun)")
    groups["model and data"].add_argument("--seed", type=int, default=0, metavar="N",
                                          help="seeds the initial weights, the batches and any other draw")
    rates = ", ".join(f"{DEFAULT_LR[name]:g} with {name}" for name in optimizers)
    groups["optimizer"].add_argument("--lr", type=float, default=None, metavar="LR",
                                     help=f"the optimizer's learning rate (default: {rates})")
    groups["compile and passes"].add_argument("--backend", default="inductor", metavar="NAME",
                                              help="torch.compile backend")


def _replica_sync(groups: dict) -> None:
    """What crosses replica groups (``train --fault-tolerant``, ``inspect --replica-groups``)."""
    group = groups["fault tolerance and replica groups"]
    group.add_argument("--replica-sync", default="step", choices=SYNC_MODES, help="between replica groups: average "
                       "gradients every step (step), exchange DeMo's top momentum components every step with sign-SGD "
                       "(demo, FlexDeMo), or average pseudo-gradients every --sync-every steps of AdamW (diloco)")
    group.add_argument("--sync-every", type=int, default=32, metavar="H", help="with diloco: inner steps per outer")
    group.add_argument("--outer-quantize", default=None, choices=("int8", "int4"), help="with diloco: send the "
                       "pseudo-gradient as int8 or int4 codes, an fp32 scale per 256 (default: fp32)")
    group.add_argument("--demo-chunk", type=int, default=64, metavar="N",
                       help="with demo: the DCT chunk's side (DeMo's)")
    group.add_argument("--demo-top-k", type=int, default=32, metavar="K",
                       help="with demo: components sent per chunk (DeMo's)")


def _train(command: argparse.ArgumentParser) -> None:
    groups = _groups(command, "model and data", "sharding", "compile and passes", "optimizer", "checkpoints",
                     "fault tolerance and replica groups", "output")
    _workload(groups, "cpu-small", 4, 128, (None, None))
    _sharding(groups)
    _accumulation(groups)
    _local_ranks(groups, tuple(DEFAULT_LR))
    _replica_sync(groups)
    group = groups["model and data"]
    group.add_argument("--data", default=None, metavar="PATH",
                       help="a text file, read as byte tokens (default: synthetic tokens)")
    group.add_argument("--variable-seq-len", action="store_true",
                       help="each step draws its sequence length in [seq-len/2, seq-len] from --seed")
    group.add_argument("--init-on-meta", action="store_true", help="build on meta, allocate and initialize shards only")
    group = groups["compile and passes"]
    group.add_argument("--no-compile", dest="compile", action="store_false", help="run the sharded model eagerly")
    group.add_argument("--precompile", action="store_true", help="save the compiled graphs under SIMPLEFSDP_CACHE and "
                       "load them in the next run instead of tracing (compile_sharded(precompile=True))")
    group = groups["optimizer"]
    group.add_argument("--steps", type=int, default=20, metavar="N",
                       help="train until this step (counting resumed steps)")
    group.add_argument("--max-norm", type=float, default=None, metavar="NORM",
                       help="clip the total gradient norm to this value (default: no clipping)")
    group.add_argument("--optimizer", default="adamw", choices=list(DEFAULT_LR),
                       help="AdamW, or GaLore 2's low-rank projected AdamW on 2-D weights (simplefsdp.optim)")
    group.add_argument("--galore-rank", type=int, default=None, metavar="R",
                       help="with --optimizer galore: the subspace's rank (default: the model's dim / 4)")
    group.add_argument("--galore-update-every", type=int, default=200, metavar="T",
                       help="with --optimizer galore: steps between subspace refreshes")
    group.add_argument("--galore-projector-dtype", type=_choice(DTYPES, "dtype"), default=None,
                       metavar="{" + ",".join(DTYPES) + "}",
                       help="with --optimizer galore: the projectors' storage (default: the parameter's own, float32)")
    group.add_argument("--galore-shard-projector", action="store_true",
                       help="with --optimizer galore: shard the projectors, all-gathered every step")
    group = groups["checkpoints"]
    group.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                       help="save sharded checkpoints (DCP) here (default: none)")
    group.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                       help="also save every N steps (0: only the last step)")
    group.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    group = groups["fault tolerance and replica groups"]
    group.add_argument("--fault-tolerant", action="store_true",
                       help="replica groups on torchft: a failed group drops out, restarts and heals (the ft extra)")
    group.add_argument("--replica-groups", type=int, default=2, metavar="N",
                       help="with --fault-tolerant: groups of --nproc ranks")
    group.add_argument("--replica-group", type=int, default=None, metavar="G", help="this group's index, under your "
                       "own torchrun (default: each group started by --fault-tolerant gets its own)")
    group.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"), metavar="URL",
                       help="a running torchft lighthouse, http://HOST:PORT (default: $TORCHFT_LIGHTHOUSE, else one "
                            "started locally)")
    group.add_argument("--max-restarts", type=int, default=3, metavar="N",
                       help="with --fault-tolerant: restarts per group")
    group.add_argument("--outer-lr", type=float, default=0.7, metavar="LR",
                       help="with diloco: the outer Nesterov SGD's lr")
    group.add_argument("--outer-momentum", type=float, default=0.9, metavar="M", help="with diloco: its momentum")
    groups["output"].add_argument("--plot", default=None, metavar="PATH",
                                  help="write the loss per step as a PNG, with matplotlib (default: no chart)")
    command.set_defaults(module="simplefsdp.train")


def _inspect(command: argparse.ArgumentParser) -> None:
    groups = _groups(command, "model and data", "sharding", "compile and passes", "trace and prediction",
                     "fault tolerance and replica groups", "output")
    _workload(groups, "llama3-8b", 1, None, ("bfloat16", "float32"))
    _sharding(groups)
    _replica_sync(groups)
    groups["sharding"].add_argument("--world-size", type=int, default=8, metavar="N",
                                    help="ranks to shard over (traced in this process)")
    groups["compile and passes"].add_argument("--dynamic", action="store_true",
                                              help="trace batch and sequence sizes as symbols")
    group = groups["trace and prediction"]
    group.add_argument("--rank", type=int, default=0, metavar="R", help="the rank of the world whose graphs are traced")
    group.add_argument("--device", default=None, choices=DEVICES,
                       help="trace on meta (any torch) or fake CUDA tensors (a CUDA build and a GPU; no GPU memory) "
                            "(default: cuda for a GPU --hardware where a GPU is visible, else meta)")
    group.add_argument("--hardware", default="h100", metavar="NAME|PATH",
                       help=f"the profile to predict on: {', '.join(PROFILE_NAMES)}, or a profile JSON path")
    groups["fault tolerance and replica groups"].add_argument(
        "--replica-groups", type=int, default=1, metavar="N",
        help="price train --fault-tolerant: groups of --world-size ranks averaging after backward")
    groups["output"].add_argument("--out", default=None, metavar="DIR", help="folder for each stage's graphs, "
                                  "plan.txt, summary.txt, summary.json, timeline.png (with matplotlib) and trace.json "
                                  "(default: only print the summary)")
    command.set_defaults(module="simplefsdp.inspection")


def _bench(command: argparse.ArgumentParser) -> None:
    groups = _groups(command, "contenders and measurement", "model and data", "sharding", "compile and passes",
                     "optimizer", "output")
    _workload(groups, "cpu-small", 4, 128, (None, None))
    _accumulation(groups)
    _local_ranks(groups, ("adamw",))
    groups["optimizer"].add_argument("--foreach", action="store_true",
                                     help="AdamW's foreach implementation for every contender instead of the fused one "
                                          "(torchtitan's and Hugging Face Trainer's default)")
    group = groups["contenders and measurement"]
    group.add_argument("--only", type=contenders_arg, default=None, metavar="NAME[,NAME]",
                       help=f"the contenders to run, of: {', '.join(CONTENDER_NAMES)} (default: all)")
    group.add_argument("--steps", type=int, default=20, metavar="N", help="measured steps per contender")
    group.add_argument("--warmup", type=int, default=3, metavar="N",
                       help="steps before measuring (compilation happens here)")
    group = groups["output"]
    group.add_argument("--json", default="runs/bench.json", metavar="PATH", help="where to write the results as JSON")
    group.add_argument("--plot", default=None, metavar="PATH", help="where to write the bar chart as a PNG "
                       "(default: runs/bench.png, skipped with a note when matplotlib is not installed)")
    group.add_argument("--from-json", default=None, metavar="PATH", help="print the table, plot and check parity "
                       "from a saved JSON instead of running (default: run)")
    group.add_argument("--rank-output", default=None, help=argparse.SUPPRESS)
    command.set_defaults(module="simplefsdp.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simplefsdp", description="Fully Sharded Data Parallel compiled by "
                                     "torch.compile; each command's --help lists its options.")
    commands = parser.add_subparsers(title="commands", dest="command", required=True)
    for name, add_options, summary in (
        ("train", _train, "train a model on local ranks"),
        ("inspect", _inspect, "trace a model at any world size and predict its step"),
        ("bench", _bench, "compare simplefsdp with FSDP2, DDP and a local baseline, side by side"),
    ):
        add_options(commands.add_parser(name, help=summary, description=summary, formatter_class=_DefaultsShown))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return importlib.import_module(args.module).run(args, argv)
