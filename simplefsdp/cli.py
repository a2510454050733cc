"""The ``simplefsdp`` command line: one subcommand per verb."""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_arg(name: str) -> torch.dtype:
    """Parse a dtype name for ``--param-dtype`` / ``--reduce-dtype``."""
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def build_parser() -> argparse.ArgumentParser:
    from simplefsdp import inspection, train

    parser = argparse.ArgumentParser(prog="simplefsdp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train.add_arguments(commands.add_parser("train", help="train a reference model on local ranks"))
    inspection.add_arguments(
        commands.add_parser("inspect", help="trace a reference model at any world size and predict its step")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return args.run(args, argv)
