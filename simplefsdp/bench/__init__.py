"""``simplefsdp bench``: simplefsdp side by side with eager FSDP2, FSDP2 + compile, DDP and a local floor, every
contender on the same ranks (``measure``); the launching process reports and checks loss parity (``report``)."""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path

from simplefsdp import plots
from simplefsdp.bench.measure import measure
from simplefsdp.bench.report import report
from simplefsdp.models.workload import load_workload
from simplefsdp.runtime.launch import is_launched_rank, launch_local_ranks, leave_rank


def _fail(message: str) -> None:
    raise SystemExit(f"simplefsdp bench: {message}")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the comparison on ``--nproc`` local ranks (or this torchrun rank), then report; 1 on a parity failure."""
    if args.plot and (reason := plots.missing()):
        _fail(f"--plot {args.plot}: {reason}")
    if args.from_json:
        path = Path(args.from_json)
        if not path.is_file():
            _fail(f"--from-json {path}: no such file; write one with --json PATH first")
        return report(json.loads(path.read_text()), args.json, args.plot)
    if min(args.nproc, args.steps, args.warmup, args.batch_size, args.seq_len) < 1:
        _fail("--nproc, --steps, --warmup, --batch-size and --seq-len must be at least 1")
    try:
        longest = load_workload(args.model, args.layers).max_seq_len
    except ValueError as error:
        _fail(str(error))
    if longest and args.seq_len > longest:
        _fail(f"--seq-len {args.seq_len} is longer than {args.model} supports; use --seq-len {longest} or less")
    command = shlex.join(["python", "-m", "simplefsdp", *argv])
    if is_launched_rank():
        results = measure(args)
        if results is None:
            leave_rank()
        if args.rank_output:
            Path(args.rank_output).write_text(json.dumps(results))
            leave_rank()
        leave_rank(report({**results, "command": command}, args.json, args.plot))
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "results.json"
        code = launch_local_ranks(args.nproc, [*argv, "--rank-output", str(output)])
        return code or report({**json.loads(output.read_text()), "command": command}, args.json, args.plot)
