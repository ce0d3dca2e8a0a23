"""How fast fused models run: timings, performance verdicts, calibration.

    bench/        fused vs unfused timings: timers, cases, table, cli; guard_cost
    perf          `fusion-harness perf` (`run --perf`): a verdict per architecture at real widths
    calibration   `fusion-harness calibrate`: real-width models through fusion.calibrate

May import: harness.runner and the layers below it.
"""
