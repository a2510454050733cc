"""Compare simplefsdp with FSDP2, DDP and a local baseline: ``python -m simplefsdp bench`` as a script.

    python benchmarks/compare.py --model cpu-small --nproc 2 [bench options]

All the work happens in ``simplefsdp/bench/``; this file only forwards its arguments.
"""

import sys

from simplefsdp.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
