"""`python -m harness.bench ...`: the bench command without the CLI wiring."""

import sys

from harness.bench.cli import main

sys.exit(main())
