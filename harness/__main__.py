"""`python -m harness`: the same command as `fusion-harness`."""

import sys

if __name__ == "__main__":
    try:
        from harness.cli import EXIT_INTERRUPTED, main
    except KeyboardInterrupt:  # Ctrl-C while starting up: no traceback, the usual status
        print("fusion-harness: interrupted", file=sys.stderr)
        sys.exit(130)
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before main installed its handler
        print("fusion-harness: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
