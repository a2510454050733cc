import sys

from simplefsdp.cli import main

sys.exit(main())
