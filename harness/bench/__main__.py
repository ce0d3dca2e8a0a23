"""`python -m harness.bench ...`: the bench command on its own (`fusion-harness bench`; the
code lives in harness.speed.bench, the options in harness.cli.bench)."""

import sys

from harness.cli.bench import main

sys.exit(main())
