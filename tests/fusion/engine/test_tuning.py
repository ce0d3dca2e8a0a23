"""`fusion.calibrate`: the products a fused model asks about are measured, saved and used;
and `backend=` restricts what runs whatever was measured."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import corpus
import fusion
from fusion.engine import tuning
from fusion.kernels import calibration, ops
from fusion.kernels import onednn as onednn_backend
from fusion.kernels.calibration import Entry, Ratio
from fusion.kernels.native import gemm as native_gemm
from fusion.kernels.policy import POLICY
from fusion.runtime.linear_forward import linear_forward
from fusion.runtime.merged import MergedLinear
from tests.fusion.kernels.native_helpers import force_native_on, force_onednn_row_on


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSION_HARNESS_CACHE", str(tmp_path))
    return tmp_path


def _fused_llama() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu")
    fused = copy.deepcopy(model)
    fusion.fuse(fused)
    return model, fused


def _synthetic(winner: str):
    """A `measure_key` stand-in: `winner` measured 1.5x the reference (no timing)."""

    def measure_key(op, shape, dtype, rows, *, budget_s):
        if op != "stacked":
            return None
        return Entry(
            op=op,
            shape=shape,
            dtype=dtype,
            rows=rows,
            threads=torch.get_num_threads(),
            median_us={"reference": 3.0, winner: 2.0},
            ratios={winner: Ratio(1.5, 1.4, 1.6)},
            rounds=7,
        )

    return measure_key


def test_calibrate_measures_what_the_model_asks_and_the_policy_uses_it(cache, monkeypatch) -> None:
    model, fused = _fused_llama()
    merged = [m for m in fused.modules() if isinstance(m, MergedLinear)]
    assert merged
    monkeypatch.setattr(calibration, "measure_key", _synthetic("stacked"))
    checked: list[int] = []
    monkeypatch.setattr(
        tuning, "model_check", lambda run, count, budget_s: checked.append(count) or WINS
    )
    POLICY.reset()  # the table on disk (the temporary cache: empty)
    result = tuning.calibrate(fused, tokens=(1, 3))
    assert checked == [1, 3] and "whole model at 3 tokens: 1.20x" in str(result)
    shapes = {e.shape for e in result.entries}
    assert shapes == {m.kernel_shape for m in merged}
    assert {e.rows for e in result.entries} == {1, 4}
    assert result.path is not None and result.path.parent == cache / "calibration"
    assert "stacked measured fastest" in str(result)
    # used by this process, and by the next one (from disk)
    taken: list[str] = []
    real = ops._fast_product
    monkeypatch.setattr(ops, "_fast_product", lambda k, *a: taken.append(k) or real(k, *a))
    inputs = corpus.make_inputs(model, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(fused(**inputs).logits, model(**inputs).logits)
    assert "stacked" not in taken  # 6 tokens x batch 2: bucket 16, not measured
    ids = inputs["input_ids"][:1, :3]
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, model(input_ids=ids).logits)
    assert taken.count("stacked") == len(merged)
    POLICY.reset()
    assert calibration.load_table().entries.keys() == POLICY.table.entries.keys()
    again = tuning.calibrate(fused, tokens=(1, 3))
    assert again.entries == [] and again.unchanged == len(result.entries)


WINS = Ratio(1.2, 1.1, 1.3)


def test_a_model_that_is_not_faster_vetoes_its_products_winners(cache, monkeypatch) -> None:
    """Products that won alone but leave the whole forward no faster (the model-level
    check) are vetoed: the references run, and the report and table say why."""
    model, fused = _fused_llama()
    monkeypatch.setattr(calibration, "measure_key", _synthetic("stacked"))
    monkeypatch.setattr(tuning, "model_check", lambda run, count, budget_s: Ratio(0.9, 0.85, 0.95))
    POLICY.reset()
    result = tuning.calibrate(fused, tokens=(3,))
    assert "vetoed: the references run" in str(result)
    entries = list(POLICY.table.entries.values())
    assert entries and all("measured 0.90x" in e.veto for e in entries)
    taken: list[str] = []
    real = ops._fast_product
    monkeypatch.setattr(ops, "_fast_product", lambda k, *a: taken.append(k) or real(k, *a))
    ids = corpus.make_inputs(model, seed=0)["input_ids"][:1, :3]
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, model(input_ids=ids).logits)
    assert "stacked" not in taken
    POLICY.reset()
    assert all(e.veto for e in calibration.load_table().entries.values())  # saved with it


def test_model_check_pairs_the_chosen_and_reference_forwards(monkeypatch) -> None:
    """`model_check` runs the model once per variant per round, the reference one under
    `FUSION_KERNELS=reference`, and returns their paired ratio."""
    modes: list[str] = []
    ratio = tuning.model_check(lambda count: modes.append(POLICY.mode), 4, budget_s=0.0)
    assert set(modes) == {"measured", "reference"}
    assert modes.count("reference") == modes.count("measured")
    assert ratio.q25 <= ratio.median <= ratio.q75


def test_calibrate_needs_a_way_to_run_the_model() -> None:
    with pytest.raises(TypeError, match="pass `run=`"):
        tuning.calibrate(torch.nn.Linear(2, 2), save=False)


class _Config:
    """A composite config as a multimodal model has: no vocabulary of its own, the text
    model's behind `get_text_config`, an image placeholder id among the text ids."""

    def __init__(self) -> None:
        self.image_token_id = 3
        self.text_config = SimpleNamespace(vocab_size=8, eos_token_id=[5, 6], pad_token_id=None)

    def get_text_config(self) -> SimpleNamespace:
        return self.text_config


class _Multimodal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()
        self.seen: list[torch.Tensor] = []
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, use_cache: bool) -> None:
        self.seen.append(input_ids)


def test_a_model_the_default_run_cannot_call_gets_one_line_asking_for_run() -> None:
    """A model whose inputs are not one row of ids (MusicGen: a row per codebook) fails the
    default run inside Transformers; calibrate says so in one line and asks for `run=`, the
    model's own error kept as the cause."""
    model = corpus.build("musicgen", seed=0)
    with pytest.raises(TypeError, match=r"MusicgenForCausalLM cannot run on one row") as info:
        tuning.calibrate(model, tokens=(1,), save=False)
    assert "pass `run=`" in str(info.value) and "\n" not in str(info.value)
    assert info.value.__cause__ is not None


def test_default_run_draws_the_text_vocabulary_without_special_ids() -> None:
    """A model whose top config has no `vocab_size` (a multimodal one) runs on its text
    config's vocabulary, and never on an id the configs name as a special token: an image
    placeholder without its image fails the forward."""
    model = _Multimodal()
    run = tuning.default_run(model)
    torch.manual_seed(0)
    for _ in range(20):
        run(16)
    ids = torch.cat(model.seen, dim=1)
    assert ids.shape == (1, 320)
    assert set(ids.unique().tolist()) == {0, 1, 2, 4, 7}


def test_backend_torch_runs_no_fast_kernel(monkeypatch) -> None:
    """Where every fast kernel would be eligible and the table says they win, a model
    fused with `backend="torch"` runs only torch's own ops (and `auto` does run them, so
    the test would see it)."""
    force_native_on(monkeypatch)
    force_onednn_row_on(monkeypatch)
    calls: list[str] = []
    native, row = native_gemm.run, onednn_backend.row_linear
    monkeypatch.setattr(native_gemm, "run", lambda *a: calls.append("native") or native(*a))
    monkeypatch.setattr(onednn_backend, "row_linear", lambda *a: calls.append("row") or row(*a))
    model = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu")
    for backend, expect_fast in (("torch", False), ("auto", True)):
        fused = copy.deepcopy(model)
        fusion.fuse(fused, backend=backend)
        assert any(linear_forward(m) is not None for m in fused.modules())
        calls.clear()
        for tokens in (1, 4):
            ids = torch.arange(tokens).view(1, tokens)
            with torch.no_grad():
                torch.testing.assert_close(fused(input_ids=ids).logits, model(input_ids=ids).logits)
        assert bool(calls) == expect_fast, (backend, calls)
