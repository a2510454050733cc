"""The ``simplefsdp`` command line: ``train``, ``inspect`` and ``bench``, each option shared by several defined once.

The parser is built from plain names (``simplefsdp.names``), so ``--help`` imports no torch; each command runs a
library module's ``run`` on the parsed options, importing that module only then. Those modules never import this one.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from simplefsdp.names import (AC_MODES, CONTENDER_NAMES, DEVICES, DTYPE_NAMES, MODEL_NAMES, MODES, PROFILE_NAMES,
                              SYNC_MODES)

DTYPES = {name: name for name in DTYPE_NAMES}  # parsed to names: the command modules turn them into torch dtypes
BUCKETS = {"auto": "auto", "block": "block", "none": None}


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
            f"unknown contender(s) {', '.join(unknown) or '(none given)'}; choose from: {', '.join(CONTENDER_NAMES)}"
        )
    return names


def _workload(model: str, batch_size: int, seq_len: int | None, dtypes: tuple) -> argparse.ArgumentParser:
    """--model, --batch-size, --seq-len, --param-dtype and --reduce-dtype, with one command's defaults."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default=model, choices=MODEL_NAMES, help=f"reference model ({model})")
    parser.add_argument("--layers", type=_at_least_one, default=None,
                        help="transformer blocks (default: the named model's count)")
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help=f"sequences per rank per step ({batch_size})")
    parser.add_argument("--seq-len", type=int, default=seq_len,
                        help=f"tokens per sequence ({seq_len or 'the maximum'})")
    for option, default, use in zip(("--param-dtype", "--reduce-dtype"), dtypes, ("gather and compute", "gradient")):
        shown = default or "the parameter's own"
        parser.add_argument(option, type=_choice(DTYPES, "dtype"), default=default,
                            metavar="{" + ",".join(DTYPES) + "}", help=f"{use} dtype ({shown})")
    parser.add_argument("--quantize-gather", choices=["int8"], help="send weight all-gathers in this format")
    parser.add_argument("--quantize-reduce", choices=["int8", "int4"],
                        help="exchange gradients in this format, with error feedback")
    parser.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                        help="with --quantize-reduce: no error feedback buffers")
    parser.add_argument("--quantize-block-size", type=int, default=256, metavar="N",
                        help="values per fp32 scale in the low-bit formats (256)")
    return parser


def _sharding() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--activation-checkpointing", default="none", choices=AC_MODES, help="per transformer block")
    parser.add_argument("--mode", default="fully_shard", choices=MODES)
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree: mesh (ranks // tp, tp), fully_shard over dp, Megatron TP (1)")
    parser.add_argument("--no-reshard", dest="reshard_after_forward", action="store_false",
                        help="keep gathered parameters from forward to backward")
    parser.add_argument("--buckets", type=_choice(BUCKETS, "bucket mode"), default="auto", metavar="{auto,block,none}",
                        help="bucketing of the collectives (auto; none: one collective per parameter)")
    parser.add_argument("--no-reorder", dest="reorder", action="store_false",
                        help="keep the traced order of the collectives (no prefetching, no sunk waits)")
    blocks_once = parser.add_mutually_exclusive_group()
    blocks_once.add_argument("--compile-blocks-once", action="store_const", const=True, default=None,
                             help="compile each distinct block's compute once for all its repeats, and refuse a "
                                  "model it cannot run (default: on where it can, so not with --tp or --dynamic)")
    blocks_once.add_argument("--whole-graph", dest="compile_blocks_once", action="store_const", const=False,
                             help="trace and compile every block on its own (compile_blocks_once=False)")
    parser.add_argument("--prefetch", type=int, default=1, help="all-gather buckets issued ahead (1)")
    parser.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                        help="gathered parameter bytes in flight that --buckets auto may use")
    return parser


def _accumulation() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--grad-accum-reduce", choices=("every", "last"), default=None,
                        help="simplefsdp reduces gradients after every micro-batch (sharded gradients accumulate: "
                             "ZeRO-3 memory) or only the last (full local gradients accumulate, one reduction); "
                             "default: every for fully_shard, last for replicate and hybrid_shard")
    return parser


def _local_ranks() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3, help="the optimizer's learning rate")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    return parser


def _replica_sync() -> argparse.ArgumentParser:
    """What crosses replica groups (``train --fault-tolerant``, ``inspect --replica-groups``)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--replica-sync", default="step", choices=SYNC_MODES,
                        help="between replica groups: average gradients every step (step), exchange DeMo's top "
                             "momentum components every step with sign-SGD (demo, FlexDeMo), or average "
                             "pseudo-gradients every --sync-every steps of AdamW (diloco)")
    parser.add_argument("--sync-every", type=int, default=32, metavar="H",
                        help="with diloco: inner steps per outer (32)")
    parser.add_argument("--outer-quantize", default=None, choices=("int8", "int4"),
                        help="with diloco: send the pseudo-gradient as int8 or int4 codes, an fp32 scale per 256 "
                             "(default: fp32)")
    parser.add_argument("--demo-chunk", type=int, default=64, help="with demo: the DCT chunk's side (64, DeMo's)")
    parser.add_argument("--demo-top-k", type=int, default=32, help="with demo: components sent per chunk (32, DeMo's)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simplefsdp", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    command = commands.add_parser("train", help="train a reference model on local ranks", parents=[
        _workload("cpu-small", 4, 128, (None, None)), _sharding(), _accumulation(), _local_ranks(),
        _replica_sync()])
    command.add_argument("--steps", type=int, default=20, help="train until this step (counting resumed steps)")
    command.add_argument("--variable-seq-len", action="store_true",
                         help="each step draws its sequence length in [seq-len/2, seq-len] from --seed")
    command.add_argument("--max-norm", type=float, default=None, help="clip the total gradient norm to this value")
    command.add_argument("--init-on-meta", action="store_true",
                         help="build on meta, allocate and initialize shards only")
    command.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints (DCP) here")
    command.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps; the last step always")
    command.add_argument("--resume", action="store_true",
                         help="continue from the latest checkpoint in --checkpoint-dir")
    command.add_argument("--data", default=None, help="a text file (byte tokens); synthetic tokens when absent")
    command.add_argument("--no-compile", dest="compile", action="store_false", help="run the sharded model eagerly")
    command.add_argument("--precompile", action="store_true", help="save the compiled graphs under SIMPLEFSDP_CACHE "
                         "and load them in the next run instead of tracing (compile_sharded(precompile=True))")
    command.add_argument("--plot", default=None, metavar="PATH", help="write the loss per step as a PNG (matplotlib)")
    command.add_argument("--fault-tolerant", action="store_true",
                         help="replica groups on torchft: a failed group drops out, restarts and heals (the ft extra)")
    command.add_argument("--replica-groups", type=int, default=2, help="with --fault-tolerant: groups of --nproc ranks")
    command.add_argument("--replica-group", type=int, default=None,
                         help="this group's index, under your own torchrun (started by --fault-tolerant otherwise)")
    command.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                         help="a running torchft lighthouse, http://HOST:PORT (default: $TORCHFT_LIGHTHOUSE, else "
                              "one started locally)")
    command.add_argument("--max-restarts", type=int, default=3, help="with --fault-tolerant: restarts per group")
    command.add_argument("--outer-lr", type=float, default=0.7, help="with diloco: the outer Nesterov SGD's lr (0.7)")
    command.add_argument("--outer-momentum", type=float, default=0.9, help="with diloco: its momentum (0.9)")
    command.add_argument("--optimizer", default="adamw", choices=("adamw", "galore"),
                         help="AdamW, or GaLore 2's low-rank projected AdamW on 2-D weights (simplefsdp.optim)")
    command.add_argument("--galore-rank", type=int, default=None, metavar="R",
                         help="with --optimizer galore: the subspace's rank (default: the model's dim / 4)")
    command.add_argument("--galore-update-every", type=int, default=200, metavar="T",
                         help="with --optimizer galore: steps between subspace refreshes (200)")
    command.add_argument("--galore-projector-dtype", type=_choice(DTYPES, "dtype"), default=None,
                         metavar="{" + ",".join(DTYPES) + "}",
                         help="with --optimizer galore: the projectors' storage (the parameter's own: float32)")
    command.add_argument("--galore-shard-projector", action="store_true",
                         help="with --optimizer galore: shard the projectors, all-gathered every step")
    command.set_defaults(module="simplefsdp.train")

    command = commands.add_parser("inspect", help="trace a reference model at any world size and predict its step",
                                  parents=[_workload("llama3-8b", 1, None, ("bfloat16", "float32")),
                                           _sharding(), _replica_sync()])
    command.add_argument("--world-size", type=int, default=8, help="ranks to shard over (traced in this process)")
    command.add_argument("--rank", type=int, default=0, help="the rank of the world whose graphs are traced")
    command.add_argument("--dynamic", action="store_true", help="trace batch and sequence sizes as symbols")
    command.add_argument("--hardware", default="h100", help=f"{', '.join(PROFILE_NAMES)}, or a profile JSON path")
    command.add_argument("--replica-groups", type=int, default=1,
                         help="price train --fault-tolerant: groups of --world-size ranks averaging after backward")
    command.add_argument("--device", default=None, choices=DEVICES,
                         help="trace on meta (any torch) or fake CUDA tensors (a CUDA build and a GPU; no GPU memory); "
                              "default cuda for a GPU --hardware where a GPU is visible, else meta")
    command.add_argument("--out", default=None, help="folder for each stage's graphs, plan.txt, summary.txt, "
                         "summary.json, timeline.png (with matplotlib) and trace.json")
    command.set_defaults(module="simplefsdp.inspection")

    command = commands.add_parser("bench",
                                  help="compare simplefsdp with FSDP2, DDP and a local baseline, side by side",
                                  parents=[_workload("cpu-small", 4, 128, (None, None)), _accumulation(),
                                           _local_ranks()])
    command.add_argument("--steps", type=int, default=20, help="measured steps per contender")
    command.add_argument("--warmup", type=int, default=3, help="steps before measuring (compilation happens here)")
    command.add_argument("--only", type=contenders_arg, default=None,
                         help=f"NAME[,NAME] of: {', '.join(CONTENDER_NAMES)}")
    command.add_argument("--json", default="runs/bench.json", help="where to write the results as JSON")
    command.add_argument("--plot", default=None, metavar="PATH", help="where to write the bar chart as a PNG "
                         "(default runs/bench.png, skipped with a note when matplotlib is not installed)")
    command.add_argument("--from-json", default=None, metavar="PATH",
                         help="print the table, plot and check parity from a saved JSON instead of running")
    command.add_argument("--rank-output", default=None, help=argparse.SUPPRESS)
    command.set_defaults(module="simplefsdp.bench")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return importlib.import_module(args.module).run(args, argv)
