"""`python -m harness.hf_tests --arch A [--arch B ...]`: see harness.hf_tests.compare."""

import sys

from harness.hf_tests.compare import main

sys.exit(main())
