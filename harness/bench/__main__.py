"""`python -m harness.bench ...`: the bench command without the CLI wiring (harness.speed.bench)."""

import sys

from harness.speed.bench.cli import main

sys.exit(main())
