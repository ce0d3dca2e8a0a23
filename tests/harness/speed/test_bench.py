"""harness.speed.bench: timers, grids, variants and the speedup table (no timing assertions: the
numbers themselves come from the benchmark suite, never from unit tests)."""

from __future__ import annotations

import json

import pytest
import torch

from fusion.kernels.native import gemm as native_gemm
from harness.cli import bench as bench_command
from harness.speed import bench
from harness.speed.bench.cases import copy_key, streamed_weight_bytes, variant_of
from harness.speed.bench.table import pool_copies


def test_cpu_timer_returns_one_positive_time_per_round() -> None:
    calls = []
    times = bench.time_cpu(lambda: calls.append(1), budget_s=0.01, min_rounds=5, max_rounds=7)
    assert 5 <= len(times) <= 7
    assert all(t > 0 for t in times)
    assert len(calls) >= len(times) + 2  # warm-up calls happen before the timed rounds


def test_reduced_grid_is_small_and_full_grid_covers_the_spec() -> None:
    reduced = bench.kernel_cases("cpu", torch.float32) + bench.model_cases("cpu", torch.float32)
    full = bench.kernel_cases("cpu", torch.float32, full=True) + bench.model_cases(
        "cpu", torch.float32, full=True
    )
    assert len(reduced) < len(full)
    assert {c.tokens for c in full} == {1, 16, 512, 4096}
    assert {c.kernel for c in full} == {*bench.KERNELS, *bench.MODELS}
    assert set(bench.MODELS) == {f"model_{arch}" for _, arch, _ in bench.END_TO_END}
    shapes = " ".join(c.shape for c in full)
    for width in ("H2048", "H4096", "I8192", "I14336", "E8-top2", "E64-top8"):
        assert width in shapes, width
    for case in full:
        assert case.variants[0] == bench.UNFUSED
        assert len(case.variants) >= 2
        assert len({c.id for c in full}) == len(full)


def test_every_variant_of_a_case_computes_the_same_function() -> None:
    """The variants are timed against each other, so they must agree (float32, CPU)."""
    cases = bench.kernel_cases(
        "cpu", torch.float32, kernels=["rmsnorm_llama", "rmsnorm_gemma", "act_and_mul", "qkv"],
        tokens=[3],
    )  # fmt: skip
    for case in cases:
        fns = case.build()
        results = {name: fns[name]() for name in case.variants}
        baseline = results[bench.UNFUSED]
        for name, value in results.items():
            if isinstance(baseline, list):  # separate projections vs split merged output
                value, baseline_cat = torch.cat(list(value), -1), torch.cat(baseline, -1)
                torch.testing.assert_close(value, baseline_cat, msg=f"{case.id} {name}")
            else:
                torch.testing.assert_close(value, baseline, msg=f"{case.id} {name}")


def test_moe_variants_agree_on_a_small_block() -> None:
    case = bench.moe_case(64, 32, 8, 2, 5, torch.float32, "cpu", "tiny")
    fns = case.build()
    baseline = fns[bench.UNFUSED]()
    for name in case.variants[1:]:
        torch.testing.assert_close(fns[name](), baseline, rtol=1e-5, atol=1e-6, msg=name)


def test_table_rows_and_json(tmp_path) -> None:
    case = bench.kernel_cases("cpu", torch.float32, kernels=["rmsnorm_llama"], tokens=[16])[0]
    medians = {bench.UNFUSED: 2e-3, case.variants[1]: 1e-3}
    rows = bench.rows_from_medians(case, medians, copy_bw=1e11, notes={})
    assert rows[0].speedup == pytest.approx(2.0)
    assert rows[0].copy_fraction == pytest.approx(case.bytes_moved / 1e-3 / 1e11)
    table = bench.format_table(rows, bandwidth=True)
    assert "2.00x" in table and "% copy BW" in table
    missing = bench.rows_from_medians(case, {bench.UNFUSED: 1e-3}, None, {"x": "why"})
    assert missing[0].speedup is None and "-" in bench.format_table(missing)


def test_cli_main_prints_the_table_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    status = bench_command.main(
        ["--device", "cpu", "--kernel", "rmsnorm_llama", "--tokens", "2", "--budget", "0.01",
         "--json", str(out)]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "rmsnorm_llama" in printed and "speedup" in printed
    document = json.loads(out.read_text())
    assert document["rows"] and document["machine"]["torch"] == torch.__version__


def test_cli_refuses_cuda_without_a_gpu(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench_command.main(["--device", "cuda"]) == 2


@pytest.mark.gpu
def test_cuda_timers_and_copy_bandwidth() -> None:
    """CUDA-event timing: positive per-round times; the event clock pairs start/end; the
    copy bandwidth is a positive number of bytes per second."""
    x = torch.randn(1 << 20, device="cuda")
    times = bench.time_cuda(lambda: x.mul_(1.0), budget_s=0.01)
    assert times and all(t > 0 for t in times)
    clock = bench.CudaEventClock()
    assert clock() == 0.0
    x.mul_(1.0)
    assert clock() > 0.0
    assert bench.copy_bandwidth("cuda", nbytes=1 << 26) > 0


def test_end_to_end_cases_and_compiled_ratios() -> None:
    """The speed issue's models, each with unfused and fused variants (and both compiled on
    request); the compiled ratio is compiled-unfused over compiled-fused time."""
    cases = bench.end_to_end_cases("cpu", torch.float32, tokens=[16])
    assert [c.shape for c in cases] == [name for name, _, _ in bench.END_TO_END]
    assert all(c.variants == ("unfused", "fused") for c in cases)
    compiled = bench.end_to_end_cases("cpu", torch.float32, compiled=True, tokens=[1])
    assert all(c.variants[-2:] == bench.COMPILED for c in compiled)

    def row(variant: str, ms: float) -> bench.Row:
        return bench.Row("model_llama", variant, "s", 16, "float32", "cpu", 2.0, ms, 2.0 / ms)

    lines = bench.compiled_ratios(
        [row("fused", 1.5), row("compiled", 1.2), row("fused+compiled", 1.0)]
    )
    assert lines == [
        "  model_llama s T16 float32: compiled 1.200 ms, fused+compiled 1.000 ms, 1.20x"
    ]
    lines = bench.compiled_ratios(
        [row("compiled", 1.2), row("fused+compiled", 1.0), row("fused+calibrated+compiled", 1.5)]
    )
    assert lines[1] == (
        "  model_llama s T16 float32: compiled 1.200 ms, fused+calibrated+compiled 1.500 ms, 0.80x"
    )
    assert bench.compiled_ratios([row("fused", 1.5)]) == []


def test_interleaved_cpu_timer_takes_turns_and_reads_either_clock() -> None:
    """Variants alternate round by round (so load changes fall on all alike); each gets one
    time per round on the wall clock and on the process clock; IQR is the quartile spread."""
    order: list[str] = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    for clock in bench.CLOCKS:
        order.clear()
        times = bench.time_cpu_interleaved(
            fns, budget_s=0.001, clock=clock, warmup_calls=0, min_rounds=3, max_rounds=3
        )
        assert set(times) == {"a", "b"} and all(len(t) == 3 for t in times.values())
        assert all(v >= 0 for t in times.values() for v in t)
        timed = order[2:]  # after one sizing call each
        first_b = timed.index("b")
        assert "a" in timed[first_b:]  # a ran again after b: the turns interleave
    assert bench.iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == 2.0
    assert bench.iqr([7.0]) == 0.0


def test_table_shows_medians_with_their_spread_and_the_cpu() -> None:
    row = bench.Row("model_llama", "fused", "s", 16, "float32", "cpu", 2.0, 1.0, 2.0)
    row.unfused_iqr_ms, row.fused_iqr_ms = 0.25, 0.125
    table = bench.format_table([row])
    assert "IQR" in table.splitlines()[0] and "0.2500" in table and "0.1250" in table
    info = bench.cpu_info()
    assert set(info) == {
        "cpu_model",
        "cpu_flags",
        "aten_cpu_capability",
        "native_kernel",
        "native_prefetch",
        "native_prefetch_reason",
    }
    assert info["native_kernel"] == native_gemm.status()
    assert (info["native_prefetch"], info["native_prefetch_reason"]) == (
        native_gemm.prefetch_status()
    )
    assert info["native_prefetch"] in ("l1", "l2")
    assert set(info["cpu_flags"]) <= set(bench.table.VECTOR_FLAGS)


def test_a_dense_decoder_streams_every_weight_but_the_embedding() -> None:
    """The memory floor of a dense model case (bytes one forward must read): every decoder
    parameter but the embedding table; none for a mixture of experts (routing decides)."""
    decoder = torch.nn.Module()
    decoder.embed_tokens = torch.nn.Embedding(1000, 8)
    decoder.layer = torch.nn.Linear(8, 16, bias=False)
    decoder.norm = torch.nn.LayerNorm(16)
    assert streamed_weight_bytes(decoder) == (8 * 16 + 2 * 16) * 4
    assert streamed_weight_bytes(decoder.to(torch.bfloat16)) == (8 * 16 + 2 * 16) * 2
    block = torch.nn.Module()
    block.experts = torch.nn.Module()
    block.experts.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 32, 8))
    block.experts.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 16))
    decoder.mlp = block
    assert streamed_weight_bytes(decoder) is None


def test_read_bandwidth_and_the_table_name_their_ceiling() -> None:
    # 8 MiB: a positive, finite rate (no bound on its size: the machine decides it).
    rate = bench.read_bandwidth(8 << 20, budget_s=0.01)
    assert 0 < rate < float("inf")
    row = bench.Row("model_llama", "fused", "s", 1, "float32", "cpu", 2.0, 1.0, 2.0)
    row.bandwidth_gbs, row.copy_fraction = 30.0, 0.5
    header = bench.format_table([row], bandwidth=True, ceiling="read").splitlines()[0]
    assert header.endswith("GB/s  % read BW")
    assert bench.format_table([row], bandwidth=True).splitlines()[0].endswith("% copy BW")


def test_copies_are_pooled_per_variant_and_each_copy_keeps_its_median() -> None:
    """`fused@1` is a second copy of `fused`: its rounds join the variant's pool, and each
    copy's own median is kept in make()'s order (the placement spread)."""
    pooled, per_copy = pool_copies(
        {"unfused": [1.0, 3.0, 2.0], "fused": [1.0, 1.0, 1.0], "fused@1": [4.0, 5.0, 6.0]}
    )
    assert pooled == {"unfused": [1.0, 3.0, 2.0], "fused": [1.0, 1.0, 1.0, 4.0, 5.0, 6.0]}
    assert per_copy == {"unfused": [2.0], "fused": [1.0, 5.0]}
    assert copy_key("fused", 0) == "fused" and variant_of(copy_key("fused", 2)) == "fused"


def test_every_copy_of_a_case_is_timed_and_reported() -> None:
    """A case with three copies per variant: every copy runs in the timed rounds, the rows
    carry three medians per side, and the table says so."""
    calls: dict[str, int] = {}

    def counting(key: str):
        def run() -> None:
            calls[key] = calls.get(key, 0) + 1

        return run

    keys = [copy_key(v, k) for v in ("unfused", "fused") for k in range(3)]
    case = bench.Case(
        kernel="model_llama",
        shape="s",
        dtype=torch.float32,
        device="cpu",
        tokens=1,
        make=lambda: {key: counting(key) for key in keys},
        variants=("unfused", "fused"),
        copies=3,
    )
    (row,) = bench.run_case(case, budget_s=0.001)
    assert set(calls) == set(keys)
    assert row.copies == 3 and len(row.unfused_copy_ms) == len(row.fused_copy_ms) == 3
    assert "copies' medians (3 unfused, 3 fused)" in bench.format_table([row])
    single = bench.Case(
        kernel="k",
        shape="s",
        dtype=torch.float32,
        device="cpu",
        tokens=1,
        make=lambda: {"unfused": counting("u"), "fused": counting("f")},
        variants=("unfused", "fused"),
    )
    (one,) = bench.run_case(single, budget_s=0.001)
    assert one.copies == 1 and one.fused_copy_ms is None
    assert "copies' medians" not in bench.format_table([one])


def test_model_cases_ask_for_their_copies() -> None:
    cases = bench.end_to_end_cases("cpu", torch.float32, tokens=[1], copies=3)
    assert cases and all(c.copies == 3 for c in cases)
    assert all(c.copies == 3 for c in bench.model_cases("cpu", torch.float32, copies=3))


def test_the_commands_choices_are_the_benchs_own() -> None:
    """harness.cli.bench spells them out so that its parser does not import torch."""
    from harness.runner import arch_check

    assert bench_command.KERNELS == bench.KERNELS
    assert bench_command.MODELS == bench.MODELS
    assert list(bench_command.DTYPE_NAMES) == list(arch_check.DTYPES)
