"""Running the corpus: one architecture end to end, and many in worker processes.

    arch_check        one architecture: build, fuse a copy, forwards, oracles' verdicts
    own_model_check   the engine of `fusion-harness check PATH`: a user's own model
    systems           systems under test: fusion (default), inductor, inductor-freezing, vllm
    pool, preload     long-lived worker processes with timeouts and crash replacement
    sweep             the corpus through arch_check in the pool: results, resume, Ctrl-C
    progress          progress bar / plain progress lines
    shard             `run --shard K/N` and `merge`
    repro             repro bundles: write, validate, replay

May import: harness.peers, harness.reporting, harness.oracles, harness.base.
"""
