"""harness: differential testing of fused vs unfused Transformers models.

Modules, one responsibility each:

    cli, __main__   the `fusion-harness` command (run, list, show, repro, bench)
    check           one architecture end to end: build, fuse a copy, three forwards, verdicts
    parity          the oracle: tolerance rule, error measure, masking, NaN (pure functions)
    localise        per-module localisation: record fused modules' inputs, re-run, judge
    results         result records and the JSONL results file
    pool            long-lived worker processes with per-task timeout and crash replacement
    preload         what the workers' forkserver imports once
    sweep           the corpus through `check` in the pool: JSONL, resume, Ctrl-C safety
    progress        progress bar / plain progress lines
    summary         totals, final table, JSON document, exit status
    plans           golden fusion plans per Transformers line: entries, files, diffs in words
    repro           repro bundles: write, validate, replay
    architectures   corpus names, --arch globs, test-plugin architectures
    bench           fused vs unfused timings
"""
