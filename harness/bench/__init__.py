"""`python -m harness.bench`: the documented path of the bench command (`fusion-harness bench`).

The code lives in `harness.speed.bench`; this package only keeps the module path working.
"""
