"""`python -m harness.suites.hf_tests --arch A [--arch B ...]`: see harness.suites.hf_tests.compare."""

import sys

from harness.suites.hf_tests.compare import main

sys.exit(main())
