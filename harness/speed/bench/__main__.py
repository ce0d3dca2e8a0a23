"""`python -m harness.speed.bench ...` (also `python -m harness.bench`): the bench command without the CLI wiring."""

import sys

from harness.speed.bench.cli import main

sys.exit(main())
