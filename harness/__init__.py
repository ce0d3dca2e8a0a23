"""harness: differential testing of fused vs unfused Transformers models.

Packages are layers; a module imports only from its own layer and the layers below it
(the import-linter contract states the same):

    cli/, __main__   the `fusion-harness` command: one module per subcommand, one dispatch
    speed/           bench/ (fused vs unfused timings), perf, calibration
    suites/          other test suites under fusion: the pytest plugin, Transformers' tests
    runner/          one architecture end to end (arch_check), the corpus in worker processes
                     (sweep, pool), systems under test, shards, repro bundles, `check PATH`
    peers/           other fusion engines (vLLM): their decisions vs ours, their rewrites applied
    reporting/       summary, golden plans, drift, reach, Markdown reports, the text table
    oracles/         parity, ties, localise, warned, lifecycle
    base/            architectures (what the corpus builds) and results (the JSONL records)

Two modules keep public paths: `harness.pytest_fusion` (`-p harness.pytest_fusion`) and
`harness.bench` (`python -m harness.bench`).
"""
