"""harness.speed.perf: the verdict rule, the size estimate and skip, the table, the command's
usage errors, and (slow) one architecture end to end. No test asserts a timing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import LlamaConfig, Qwen3MoeConfig

import corpus
from harness import cli
from harness.speed import perf

SMALL_LLAMA = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
"""Widths (the test hook `PerfOptions.widths`) that build and time a Llama in seconds."""


# --------------------------------------------------------------------------------------------
# The verdict rule


@pytest.mark.parametrize(
    ("q1", "q3", "expected"),
    [
        (0.80, 0.969, "slower"),  # upper quartile below 0.97: measurably slower
        (0.80, 0.97, "same"),  # at the threshold: not measurably slower
        (0.90, 1.10, "same"),  # the spread straddles 1
        (1.03, 1.20, "same"),  # lower quartile at the threshold: not measurably faster
        (1.031, 1.20, "faster"),
        (0.96, 0.98, "same"),  # a median below 0.97 is not enough: q3 must be below too
    ],
)
def test_verdict_boundaries(q1, q3, expected):
    assert perf.verdict(q1, q3) == expected


def test_token_perf_pairs_rounds_and_judges_the_ratio_quartiles():
    """Round i of both variants forms one ratio: a load spike that hits both (round 3) does
    not move the ratio, though it widens each variant's own IQR."""
    unfused = [2.0, 2.0, 20.0, 2.0, 2.0]
    fused = [1.0, 1.0, 10.0, 1.0, 1.0]
    t = perf.token_perf(16, unfused, fused)
    assert (t.ratio, t.ratio_q1, t.ratio_q3) == (2.0, 2.0, 2.0)
    assert t.verdict == "faster"
    assert t.unfused_ms == 2000.0 and t.fused_ms == 1000.0
    assert t.rounds == 5 and t.tokens == 16


def test_token_perf_slower_and_same():
    slower = perf.token_perf(1, [1.0] * 4, [1.2, 1.25, 1.3, 1.2])
    assert slower.verdict == "slower" and slower.ratio_q3 < perf.SLOWER
    noisy = perf.token_perf(1, [1.0, 1.0, 1.0, 1.0], [0.8, 1.25, 0.8, 1.25])
    assert noisy.verdict == "same"


def test_token_perf_refuses_unpaired_rounds():
    with pytest.raises(ValueError):
        perf.token_perf(1, [1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        perf.token_perf(1, [], [])


def test_quartiles():
    assert perf.quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert perf.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)


def _timing(verdict: str) -> perf.TokenPerf:
    return perf.TokenPerf(1, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 5, verdict)


def _perf(verdict: str, ratio: float = 1.0) -> perf.TokenPerf:
    return perf.TokenPerf(1, 1.0, 1.0, 0.0, 0.0, ratio, ratio, ratio, 7, verdict)


@pytest.mark.parametrize(
    ("verdicts", "calls", "judged", "noted"),
    [
        (["same"], 1, "same", False),
        (["faster"], 1, "faster", False),
        (["slower", "same"], 2, "same", True),
        (["slower", "slower"], 2, "slower", False),
    ],
)
def test_a_slower_count_is_timed_again_and_judged_on_the_second(verdicts, calls, judged, noted):
    """One `slower` alone (noise, among hundreds of judgments) is noted, not failed; two in
    a row fail; anything else is measured once."""
    timings = iter(_perf(v, 0.9 if v == "slower" else 1.0) for v in verdicts)
    made: list[perf.TokenPerf] = []
    notes: list[str] = []
    got = perf.confirmed(lambda: made.append(next(timings)) or made[-1], notes)
    assert len(made) == calls and got is made[-1] and got.verdict == judged
    assert bool(notes) == noted
    if noted:
        assert notes == ["1 tokens: slower at first (0.90x [0.90-0.90]), same timed again (1.00x)"]


@pytest.mark.parametrize(
    ("verdicts", "expected"),
    [
        (["faster", "faster"], "faster"),
        (["faster", "same"], "same"),
        (["faster", "slower"], "slower"),
        (["same", "same"], "same"),
    ],
)
def test_arch_verdict_is_the_worst_token_count(verdicts, expected):
    assert perf.arch_verdict([_timing(v) for v in verdicts]) == expected


def test_exit_status_fails_only_slower():
    records = [
        perf.ArchPerf("a", "faster"),
        perf.ArchPerf("b", "skipped: too large (9.9 GB)"),
        perf.ArchPerf("c", "error: build: RuntimeError: x"),
    ]
    assert perf.exit_status(records) == 0
    assert perf.exit_status([*records, perf.ArchPerf("d", "slower")]) == 1


# --------------------------------------------------------------------------------------------
# Real widths and the size estimate


def test_estimate_is_two_models_of_the_dtype():
    assert perf.estimate_bytes(1000, torch.float32) == 8000
    assert perf.estimate_bytes(1000, torch.bfloat16) == 4000


def test_real_width_config_keeps_the_default_widths_and_caps_depth_and_vocab():
    config = perf.real_width_config("llama", perf.PerfOptions(layers=1, vocab=512))
    default = LlamaConfig()
    assert config.hidden_size == default.hidden_size
    assert config.intermediate_size == default.intermediate_size
    assert config.num_attention_heads == default.num_attention_heads
    assert config.num_hidden_layers == 1
    assert config.vocab_size == 512
    assert config.max_position_embeddings <= perf.POSITIONS


def test_real_width_config_keeps_moe_layers_in_a_short_stack():
    """Qwen3-MoE: its experts and top-k stay at the defaults, and the 2-layer stack is MoE
    (the corpus's depth attributes come along: `decoder_sparse_step`, `mlp_only_layers`)."""
    config = perf.real_width_config("qwen3_moe", perf.PerfOptions())
    default = Qwen3MoeConfig()
    assert config.num_experts == default.num_experts
    assert config.num_experts_per_tok == default.num_experts_per_tok
    assert config.moe_intermediate_size == default.moe_intermediate_size
    assert config.num_hidden_layers == 2
    assert not config.mlp_only_layers


def test_a_size_the_default_leaves_unset_is_kept_or_derived_or_the_tiny_count():
    """A default config's None size is kept (an optional feature left off) unless asked to
    fill it: then the head width is the real hidden width over the real heads, unset
    key/value heads are the attention heads, and another count is the tiny one."""
    default = LlamaConfig()
    default.head_dim = None
    default.num_key_value_heads = None
    default.pretraining_tp = None
    tiny = {"head_dim": 16, "num_key_value_heads": 2, "pretraining_tp": 3, "hidden_size": 64}
    kept = perf.real_width_kwargs(default, tiny, perf.PerfOptions())
    assert not {"head_dim", "num_key_value_heads", "pretraining_tp"} & set(kept)
    kw = perf.real_width_kwargs(default, tiny, perf.PerfOptions(), fill_unset=True)
    assert kw["head_dim"] == default.hidden_size // default.num_attention_heads
    assert kw["num_key_value_heads"] == default.num_attention_heads
    assert kw["pretraining_tp"] == 3
    assert "hidden_size" not in kw  # a width the default sets stays the default's


@pytest.mark.parametrize("arch", ["dots1", "hunyuan_v1_dense", "ministral", "nemotron"])
def test_models_whose_defaults_leave_sizes_unset_are_sized_with_them_filled(arch):
    """dots1 (expert counts), HunYuan and Ministral (head width) and Nemotron (key/value
    heads) default to None sizes their models cannot be built from; the verdict recorded
    an error for each before any timing."""
    with pytest.raises(TypeError):
        perf.count_params(arch, perf.real_width_config(arch, perf.PerfOptions()))
    config, params, filled = perf.sized_config(arch, perf.PerfOptions())
    assert filled and params == perf.count_params(arch, config) > 0


@pytest.mark.parametrize("arch", ["jamba", "reformer"])
def test_models_whose_tiny_config_sets_layer_kinds_or_flags_build_at_real_widths(arch):
    """Jamba's attention offset is a layer-kind setting (the default offset lay past the
    tiny period); Reformer's causal LM needs `is_decoder`."""
    _, params, filled = perf.sized_config(arch, perf.PerfOptions())
    assert not filled and params > 0


def test_an_unset_head_width_is_the_models_own():
    """Qwen4-Exp's token indexer (its tiny layer kinds use it) is unset by default; filled,
    its head is the model's own head width, as a tiny head would not fit the real rotary
    width (the config refuses it), and its counts the tiny ones."""
    config, params, filled = perf.sized_config("qwen4_exp_text", perf.PerfOptions())
    assert filled and params > 0
    assert config.indexer_head_dim == config.head_dim
    assert config.indexer_n_heads == perf.tiny_kwargs("qwen4_exp_text")["indexer_n_heads"]


def test_an_auxiliary_vocabulary_of_the_default_size_follows_the_cap():
    """Gemma 4's per-layer input embedding is indexed by the same ids as the token embedding
    (its default vocabulary is the same): capped alike, ids past the tiny auxiliary size
    no longer index out of range."""
    options = perf.PerfOptions(vocab=512)
    config = perf.real_width_config("gemma4_text", options)
    assert config.vocab_size == config.vocab_size_per_layer_input == 512


def test_widths_hook_overrides_real_widths():
    config = perf.real_width_config("llama", perf.PerfOptions(widths=SMALL_LLAMA))
    assert config.hidden_size == 128 and config.intermediate_size == 256


def test_count_params_on_meta_matches_a_real_build():
    options = perf.PerfOptions(widths=SMALL_LLAMA, vocab=256)
    config = perf.real_width_config("llama", options)
    model = corpus.build_from_config(config, name="llama")
    assert perf.count_params("llama", config) == sum(p.numel() for p in model.parameters())


def test_calibration_runs_the_timed_forward_on_the_corpus_inputs(monkeypatch):
    """The verdict calibrates on the forward it times, inputs made once per token count: a
    model whose inputs are not one row of ids (MusicGen: one row per codebook) is
    calibrated too (the default run of `fusion.calibrate` failed on its shape)."""
    model = corpus.build("musicgen", seed=0)
    made: list[int] = []
    real = perf.decoder_forward
    monkeypatch.setattr(perf, "decoder_forward", lambda m, n, s: made.append(n) or real(m, n, s))
    run = perf.calibration_run(model, seed=0)
    first, again = run(3), run(3)
    assert made == [3]
    assert torch.equal(first.last_hidden_state, again.last_hidden_state)
    run(5)
    assert made == [3, 5]


def test_too_large_is_skipped_with_the_estimate_before_building(monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("a model over the limit must not be built")

    monkeypatch.setattr(perf, "build_from_config", no_build)
    record = perf.measure_arch("llama", perf.PerfOptions(max_gb=0.5))
    assert record.verdict.startswith("skipped: too large (")
    assert record.verdict.endswith(" GB)")
    assert record.estimate_gb is not None and record.estimate_gb > 0.5
    assert record.params is not None and record.timings == []
    assert perf.exit_status([record]) == 0


def test_a_failing_build_is_recorded_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no memory\nsecond line")

    monkeypatch.setattr(perf, "build_from_config", broken)
    record = perf.measure_arch("llama", perf.PerfOptions(widths=SMALL_LLAMA))
    assert record.verdict == "error: build: RuntimeError: no memory"


# --------------------------------------------------------------------------------------------
# Reporting and the command


def test_format_table_rows_and_alignment():
    timings = [
        perf.TokenPerf(1, 26.0, 21.95, 0.7, 0.6, 1.19, 1.15, 1.22, 9, "faster"),
        perf.TokenPerf(128, 422.4, 440.0, 22.0, 23.2, 0.96, 0.94, 0.965, 7, "slower"),
    ]
    records = [
        perf.ArchPerf("llama", "slower", timings),
        perf.ArchPerf("qwen3_moe", "skipped: too large (9.9 GB)"),
    ]
    lines = perf.format_table(records).splitlines()
    assert lines[0].startswith("arch") and lines[0].split()[-1] == "verdict"
    assert "ratio [IQR]" in lines[0] and "unfused ms" in lines[0]
    assert lines[2].split() == ["llama", "1", "26.00", "21.95", "1.19x", "[1.15-1.22]", "faster"]
    assert lines[3].split() == ["128", "422.40", "440.00", "0.96x", "[0.94-0.96]", "slower"]
    assert lines[4].split()[0] == "qwen3_moe" and lines[4].endswith("skipped: too large (9.9 GB)")
    assert lines[2].index("faster") == lines[0].index("verdict")
    assert perf.summary_line(records) == "perf: 0 faster, 0 same, 1 slower, 1 skipped, 0 error"


@pytest.mark.parametrize(
    "argv",
    [
        ["perf", "--tokens", "0"],
        ["perf", "--tokens", "a,b"],
        ["perf", "--layers", "0"],
        ["perf", "--vocab", "100"],
        ["perf", "--generate", "8"],
        ["perf", "--generate", "0,4"],
        ["perf", "--arch", "no-such-architecture"],
        ["run", "--perf", "--perf-max-gb", "-1"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # a range its argparse types refuse (harness.cli.argtypes)
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-harness perf: error:") and err.count("\n") == 1


def test_run_perf_hands_off_with_the_perf_spellings(monkeypatch):
    seen = {}

    def fake_run(archs, options, progress, records, done):
        seen.update(archs=archs, options=options)
        records.append(perf.ArchPerf(archs[0], "slower", [_timing("slower")]))
        return records

    monkeypatch.setattr(perf, "run", fake_run)
    status = cli.main(
        ["run", "--perf", "--arch", "llama", "--perf-tokens", "1,16", "--perf-layers", "1"]
    )
    assert status == 1  # a slower architecture fails the command
    assert seen["archs"] == ["llama"]
    assert seen["options"].tokens == (1, 16) and seen["options"].layers == 1
    assert seen["options"].generate == perf.GENERATE
    cli.main(["perf", "--arch", "llama", "--generate", "off"])
    assert seen["options"].generate is None
    cli.main(["perf", "--arch", "llama", "--generate", "4,2"])
    assert seen["options"].generate == (4, 2)


def test_a_model_that_cannot_generate_is_noted_and_keeps_its_forward_verdict(monkeypatch):
    def cannot(*args, **kwargs):
        raise TypeError("no generate here")

    monkeypatch.setattr(perf, "greedy", cannot)
    monkeypatch.setattr(perf, "prompt_ids", lambda model, prompt, seed: torch.ones(1, prompt))
    notes: list[str] = []
    assert perf.generate_perf(None, None, perf.PerfOptions(), notes) is None
    assert notes and "cannot" in notes[0] and "no generate here" in notes[0]


# --------------------------------------------------------------------------------------------
# End to end (slow): one small architecture, record structure only


@pytest.mark.slow
def test_one_architecture_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FUSION_HARNESS_CACHE", str(tmp_path / "cache"))
    options = perf.PerfOptions(tokens=(1, 4), budget_s=0.05, min_rounds=3, widths=SMALL_LLAMA)
    previous = torch.get_num_threads()
    try:
        record = perf.measure_arch("llama", options)
    finally:
        torch.set_num_threads(previous)
    assert record.verdict in ("faster", "same", "slower"), record.verdict
    assert record.layers == 2 and record.fused_modules > 0
    assert record.params and record.estimate_gb and record.estimate_gb < options.max_gb
    assert [(t.kind, t.tokens) for t in record.timings] == [
        ("forward", 1),
        ("forward", 4),
        ("generate", perf.GENERATE[1]),
    ]
    assert record.notes == []  # float32, uncalibrated table: the unfused greedy tokens
    for t in record.timings:
        assert t.rounds >= 3 and t.unfused_ms > 0 and t.fused_ms > 0
        assert t.ratio_q1 <= t.ratio <= t.ratio_q3
        assert t.verdict == perf.verdict(t.ratio_q1, t.ratio_q3)
    assert record.verdict == perf.arch_verdict(record.timings)
    doc = perf.document([record], options)
    text = json.dumps(doc)
    assert json.loads(text)["records"][0] == dataclasses.asdict(record)
    assert doc["thresholds"] == {"slower": perf.SLOWER, "faster": perf.FASTER}


def test_the_commands_defaults_are_perfs_own():
    """harness.cli.perf and harness.cli.calibrate spell them out so that their parsers do not
    import torch."""
    from fusion.kernels import calibration as kernel_calibration
    from harness.cli import calibrate as calibrate_command
    from harness.cli import perf as perf_command
    from harness.speed import calibration
    from harness.speed import perf as speed_perf

    for name in ("SLOWER", "FASTER", "TOKENS", "GENERATE", "LAYERS", "VOCAB", "MAX_GB", "BUDGET_S"):
        assert getattr(perf_command, name) == getattr(speed_perf, name), name
    assert list(speed_perf.DTYPES) == list(perf_command.common.DTYPE_NAMES)
    assert list(calibrate_command.MODELS) == list(calibration.MODELS)
    assert calibrate_command.BUDGET_S == kernel_calibration.BUDGET_S


def test_an_interrupted_run_keeps_every_finished_architecture(tmp_path, monkeypatch, capsys):
    """Each architecture's verdict is told as it finishes and written to `--json` at once;
    Ctrl-C during the next prints the table and summary of those finished, leaves the JSON
    marked incomplete and exits 130 (1 where one was slower)."""
    timing = perf.TokenPerf(1, 2.0, 1.0, 0.1, 0.1, 2.0, 1.9, 2.1, 5, "faster")

    def measure(arch, options, progress):
        if arch == "qwen3":
            raise KeyboardInterrupt
        return perf.ArchPerf(arch, "faster", [timing], seconds=3.0)

    monkeypatch.setattr(perf, "measure_arch", measure)
    out = tmp_path / "perf.json"
    status = cli.main(["perf", "--arch", "llama", "qwen3", "--json", str(out)])
    captured = capsys.readouterr()
    assert status == 130
    assert "perf: llama: faster (1: 2.00x; 3 s)" in captured.err
    assert "interrupted after 1 of 2 architectures" in captured.err
    assert "llama" in captured.out and "qwen3" not in captured.out
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and [r["arch"] for r in doc["records"]] == ["llama"]
    monkeypatch.setattr(
        perf,
        "measure_arch",
        lambda arch, options, progress: perf.ArchPerf(
            arch, "slower", [dataclasses.replace(timing, verdict="slower")]
        ),
    )
    assert cli.main(["perf", "--arch", "llama", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["complete"] is True
