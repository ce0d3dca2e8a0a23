"""`python -m harness.bench.guard_cost`: the documented path of the guard-cost timings
(the code lives in `harness.speed.bench.guard_cost`)."""

from harness.speed.bench.guard_cost import main

if __name__ == "__main__":
    raise SystemExit(main())
