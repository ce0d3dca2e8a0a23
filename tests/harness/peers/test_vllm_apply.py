"""harness.peers.vllm_apply: vLLM's rewrites applied for the oracles. Its bookkeeping, weight
loading and fail-closed paths on stand-ins (no vLLM needed), the `vllm` system's refusal where
vLLM does not import, and (only where vLLM imports: the peer environment) vLLM's rewrite of
tiny models judged by the parity oracle."""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from harness import cli
from harness.base import architectures
from harness.peers import vllm_apply
from harness.peers.vllm_apply import Application, ApplyError, Rewrite, Skipped
from harness.runner import arch_check, systems

HAS_VLLM = importlib.util.find_spec("vllm") is not None
VLLM_PROBLEM = systems.unavailable("vllm") if HAS_VLLM else None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM or VLLM_PROBLEM is not None,
    reason=VLLM_PROBLEM or "vLLM is not importable here (peer environment: scripts/vllm_peer.sh)",
)


# ------------------------------------------------------------------------ bookkeeping


def test_the_summary_counts_applied_and_left_families_and_names_the_gemms():
    app = Application(
        applied=[
            Rewrite("a", "A", "qkv", "QKVFuser"),
            Rewrite("b", "A", "qkv", "QKVFuser"),
            Rewrite("n", "N", "rms_norm", "RMSNormFuser"),
        ],
        not_applied=[Skipped("m", "M", "moe", "why")],
        gemms={"a.qkv_proj": "F.linear", "b.qkv_proj": "oneDNN onednn_mm"},
    )
    assert app.counts() == {"qkv": 2, "rms_norm": 1}
    assert app.summary() == (
        "vLLM applied: qkv x2, rms_norm x1; not applied: moe x1; GEMM: F.linear, oneDNN onednn_mm"
    )
    assert Application().summary() == "vLLM applied: nothing"


def test_the_gemm_is_named_by_the_op_its_lambda_calls():
    ops = SimpleNamespace(onednn_mm=None, weight_packed_linear_cpu=None)
    assert vllm_apply._gemm_name(lambda x, w, b: ops.onednn_mm(None, x, b)) == "oneDNN onednn_mm"
    assert (
        vllm_apply._gemm_name(lambda x, w, b: ops.weight_packed_linear_cpu(x, w, 1, b))
        == "sgl weight_packed_linear"
    )
    assert vllm_apply._gemm_name(lambda x, w, b: torch.nn.functional.linear(x, w, b)) == (
        "F.linear"
    )
    assert vllm_apply._gemm_name(torch.nn.functional.linear) == "F.linear"
    assert vllm_apply._gemm_name(lambda x, w, b: x @ w) == "unknown"
    assert vllm_apply._gemm_name(None) == "none"


def test_the_default_dtype_is_restored_even_when_the_body_raises():
    before = torch.get_default_dtype()
    with pytest.raises(RuntimeError), vllm_apply._default_dtype(torch.bfloat16):
        assert torch.empty(1).dtype == torch.bfloat16
        raise RuntimeError("boom")
    assert torch.get_default_dtype() == before


# ------------------------------------------------------------------------ weight loading


class _Stacked(nn.Module):
    """A stand-in for vLLM's merged linear: one weight, shards loaded by a weight_loader."""

    def __init__(self, rows: dict[str, int], cols: int) -> None:
        super().__init__()
        self.offsets = {}
        start = 0
        for shard, n in rows.items():
            self.offsets[shard] = (start, n)
            start += n
        self.weight = nn.Parameter(torch.full((start, cols), float("nan")))
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard: str) -> None:
        start, n = self.offsets[shard]
        with torch.no_grad():
            param[start : start + n].copy_(tensor)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False)
        self.b = nn.Linear(4, 2, bias=False)
        self.keep = nn.Linear(4, 4)


def _rewritten() -> tuple[_Pair, dict, dict, dict]:
    """A model whose a/b a stand-in rewrite merged into `ab`, with the loading inputs."""
    model = _Pair()
    originals = dict(model.state_dict(keep_vars=True))
    copies = {k: v.detach().clone() for k, v in originals.items()}
    del model.a, model.b
    model.ab = _Stacked({"a": 3, "b": 2}, 4)
    mapping = {"a": ("ab", "a"), "b": ("ab", "b")}
    return model, originals, copies, mapping


def test_merged_shards_are_loaded_through_their_loader_and_untouched_tensors_left():
    model, originals, copies, mapping = _rewritten()
    loaded = vllm_apply._load(model, originals, copies, mapping)
    assert loaded == 2  # a and b; keep.weight / keep.bias are the same objects as before
    torch.testing.assert_close(model.ab.weight[:3], copies["a.weight"])
    torch.testing.assert_close(model.ab.weight[3:], copies["b.weight"])
    assert model.keep.weight is originals["keep.weight"]


def test_a_tensor_with_no_place_after_the_rewrite_fails_closed():
    model, originals, copies, mapping = _rewritten()
    del mapping["b"]
    with pytest.raises(ApplyError, match=r"b\.weight has no Parameter or buffer"):
        vllm_apply._load(model, originals, copies, mapping)


def test_a_new_parameter_no_tensor_reached_fails_closed():
    model, originals, copies, mapping = _rewritten()
    model.extra = nn.Linear(2, 2)  # a layer the rewrite created, with nothing to load
    with pytest.raises(ApplyError, match=r"created extra\.weight, which no tensor was loaded"):
        vllm_apply._load(model, originals, copies, mapping)


def test_a_new_parameter_equal_to_the_models_unsaved_buffer_of_its_name_is_kept():
    model, originals, copies, mapping = _rewritten()
    model.norm = nn.Module()
    model.norm.weight = nn.Parameter(torch.ones(4))  # vLLM's RMSNorm starts at ones
    ones = {"norm.weight": torch.ones(4)}  # a weightless norm's non-persistent buffer
    assert vllm_apply._load(model, originals, copies, mapping, ones) == 2
    with pytest.raises(ApplyError, match=r"created norm\.weight"):
        vllm_apply._load(model, originals, copies, mapping, {"norm.weight": torch.zeros(4)})


class _Recorded(_Stacked):
    """A stand-in for vLLM 0.34's StackedColumnParallelLinear: the loader records the shards
    each parameter received; `pop_missing_shards` names the rest and forgets the record."""

    def __init__(self, rows: dict[str, int], cols: int) -> None:
        super().__init__(rows, cols)
        self.loaded: dict[str, set[str]] = {}

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard: str) -> None:
        super()._load(param, tensor, shard)
        self.loaded.setdefault("weight", set()).add(shard)

    def pop_missing_shards(self) -> list[str]:
        loaded, self.loaded = self.loaded, {}
        return [f"{n}.{s}" for n, got in loaded.items() for s in self.offsets if s not in got]


def test_a_fused_weight_missing_a_shard_is_named_as_vllm_0_34_names_it():
    """vLLM 0.34's loader rule: a fused weight that got some shards but not all is a load
    error. Without the rule the half-filled weight passes the parameter-level check (it did
    receive a tensor) and keeps NaN rows."""
    model, originals, copies, mapping = _rewritten()
    model.ab = _Recorded({"a": 3, "b": 2}, 4)
    del copies["b.weight"], originals["b.weight"]  # the checkpoint lacks b
    vllm_apply._load(model, originals, copies, mapping)  # passes the parameter-level check
    assert torch.isnan(model.ab.weight[3:]).all()
    assert vllm_apply.missing_shards(model) == ["ab.weight.b"]
    assert vllm_apply.missing_shards(model) == []  # the record is cleared, as vLLM's is
    whole, originals, copies, mapping = _rewritten()
    whole.ab = _Recorded({"a": 3, "b": 2}, 4)
    vllm_apply._load(whole, originals, copies, mapping)
    assert vllm_apply.missing_shards(whole) == []
    assert vllm_apply.missing_shards(_rewritten()[0]) == []  # 0.33's layers: no record


def test_a_replaced_module_without_a_loader_is_copied_into():
    model = _Pair()
    originals = dict(model.state_dict(keep_vars=True))
    copies = {k: v.detach().clone() for k, v in originals.items()}
    model.keep = nn.Linear(4, 4)  # as vLLM's RowParallelLinear replaces an output projection
    assert vllm_apply._load(model, originals, copies, {}) == 2
    torch.testing.assert_close(model.keep.weight, copies["keep.weight"])


# ------------------------------------------------------------------------ rewriting


class _Fuser:
    """A stand-in vLLM fuser; its class name picks the family (harness.peers.vllm)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.shards = []

    def orig_to_new_stacked(self, prefix: str) -> dict:
        return {}

    def fuse(self, module, prefix, config):
        if self.fail:
            raise ValueError("cannot rewrite")
        return module


class QKVFuser(_Fuser):
    pass


class AttentionFuser(_Fuser):
    pass


class _Runtime:
    def __init__(self, table: dict[type, list]) -> None:
        self.table = table

    def modules(self) -> SimpleNamespace:
        table = self.table

        class Fusers:
            def __init__(self, model, config) -> None:
                pass

            def __getitem__(self, module):
                return table.get(type(module), [])

        return SimpleNamespace(fuser=SimpleNamespace(Fusers=Fusers))


def _llama() -> nn.Module:
    return architectures.build("llama", seed=0, dtype=torch.float32, device="cpu")


def test_families_not_run_here_are_recorded_with_their_reason_and_others_applied():
    model = _llama()
    attention = type(model.model.layers[0].self_attn)
    runtime = _Runtime({attention: [QKVFuser(), AttentionFuser()]})
    app = Application()
    vllm_apply._rewrite(model, runtime, app)
    layers = len(model.model.layers)
    assert app.counts() == {"qkv": layers}
    assert [s.family for s in app.not_applied] == ["attention"] * layers
    assert all(s.reason == vllm_apply.NOT_RUN["attention"] for s in app.not_applied)


def test_a_fuser_that_raises_fails_the_whole_rewrite_naming_the_module():
    model = _llama()
    mlp = type(model.model.layers[0].mlp)
    with pytest.raises(ApplyError, match=r"QKVFuser on model\.layers\.0\.mlp .*cannot rewrite"):
        vllm_apply._rewrite(model, _Runtime({mlp: [QKVFuser(fail=True)]}), Application())


def test_an_moe_block_is_left_whole_with_its_reason():
    model = architectures.build("qwen3_moe", seed=0, dtype=torch.float32, device="cpu")
    block = type(model.model.layers[0].mlp)
    experts = type(model.model.layers[0].mlp.experts)
    runtime = _Runtime({block: [QKVFuser()], experts: [QKVFuser()]})
    app = Application()
    vllm_apply._rewrite(model, runtime, app)
    assert app.applied == []  # neither the block nor anything inside it is offered
    assert {s.family for s in app.not_applied} == {"moe"}
    assert len(app.not_applied) == len(model.model.layers)


# ------------------------------------------------------------------------ without vLLM


def test_without_vllm_the_runtime_says_where_it_runs(monkeypatch):
    def no_vllm(name: str):
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(vllm_apply.importlib, "import_module", no_vllm)
    with pytest.raises(vllm_apply.PeerUnavailable, match="tox -e vllm-peer"):
        vllm_apply.VllmRuntime().modules()


def test_a_vllm_that_will_not_make_its_config_here_makes_the_system_unavailable(monkeypatch):
    """vLLM 0.34 on an x86 CPU without triton-cpu raises from VllmConfig: the `vllm` system
    is then refused with vLLM's reason, not failed architecture by architecture."""

    def refuse(**kwargs):
        raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")

    fake = SimpleNamespace(
        config=SimpleNamespace(VllmConfig=refuse, CompilationConfig=lambda **kwargs: None)
    )
    runtime = vllm_apply.VllmRuntime()
    runtime._vllm = fake
    with pytest.raises(vllm_apply.PeerUnavailable, match=r"requires Triton .*triton-cpu wheel"):
        runtime.config()
    monkeypatch.setattr(vllm_apply, "RUNTIME", runtime)
    assert "vLLM cannot make its config on this machine" in systems.unavailable("vllm")


def test_the_cli_refuses_the_vllm_system_where_vllm_does_not_import(monkeypatch, capsys):
    monkeypatch.setattr(
        systems, "unavailable", lambda name: "vLLM does not import here" if name else None
    )
    code = cli.main(["run", "--system", "vllm", "--arch", "llama"])
    assert code == cli.EXIT_USAGE
    assert "--system vllm: vLLM does not import here" in capsys.readouterr().err


def test_only_the_peer_systems_can_be_unavailable():
    """Our engine and Inductor need only torch; `vllm` and `liger` name what they lack (the
    peer environment; liger-kernel, or Triton's interpreter where no GPU is: the README's test
    command does not set TRITON_INTERPRET)."""
    peers = {"vllm", "liger"}
    assert all(systems.unavailable(name) is None for name in systems.NAMES if name not in peers)
    for name in peers:
        reason = systems.unavailable(name)
        assert reason is None or reason.strip(), name


def test_liger_without_a_gpu_asks_for_the_interpreter(monkeypatch):
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (the test extra)")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: Liger's kernels need no interpreter")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in systems.unavailable("liger")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert systems.unavailable("liger") is None


def test_the_vllm_system_records_its_applied_counts_and_summary(monkeypatch):
    def fake(model, runtime=None):
        return Application(applied=[Rewrite("x", "X", "glu", "GLUFuser")])

    monkeypatch.setattr(vllm_apply, "apply", fake)
    system = systems.get("vllm")
    assert system.note() == ""  # nothing applied yet
    prepared = system.apply(nn.Linear(2, 2))
    assert prepared.applied == {"glu": 1} and prepared.report is None
    assert system.note() == "vLLM applied: glu x1"
    assert not system.lifecycle and not system.golden


# ------------------------------------------------------------------------ with vLLM


@needs_vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gpt_bigcode"])
def test_vllm_rewrites_tiny_models_and_the_parity_oracle_judges_them(arch, dtype):
    options = arch_check.CheckOptions(system="vllm", dtype=dtype)
    result = arch_check.check_architecture(arch, options).result
    assert result.status == "pass", result.message
    assert result.message.startswith("vLLM applied: ")
    assert result.applied, "vLLM applied nothing: the system judged an unchanged model"


@needs_vllm
def test_vllm_s_rewrite_of_llama_is_bit_identical_in_float32():
    model = _llama().eval()
    unfused = _llama().eval()
    app = vllm_apply.apply(model)
    assert app.counts() == {"glu": 2, "qkv": 2, "rms_norm": 5}
    assert type(model.model.layers[0].self_attn.qkv_proj).__name__ == "QKVParallelLinear"
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, unfused(ids).logits, rtol=0, atol=0)


@needs_vllm
def test_a_shard_missing_from_the_checkpoint_fails_the_apply(monkeypatch):
    """vLLM 0.34 (where its layers record loaded shards): a q/k/v weight whose k never
    arrives is an ApplyError naming the shard, not a model with uninitialised rows."""
    load = vllm_apply._load

    def without_k(model, originals, copies, mapping, unsaved=None):
        key = "model.layers.0.self_attn.k_proj.weight"
        copies = {k: v for k, v in copies.items() if k != key}
        return load(model, originals, copies, mapping, unsaved)

    monkeypatch.setattr(vllm_apply, "_load", without_k)
    model = _llama().eval()
    linear = importlib.import_module("vllm.model_executor.layers.linear")
    if not hasattr(linear, "StackedColumnParallelLinear"):
        pytest.skip("this vLLM (before 0.34) records no loaded shards")
    with pytest.raises(ApplyError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight\.k"):
        vllm_apply.apply(model)
