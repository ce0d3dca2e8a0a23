"""harness.peers: the module-by-module comparison with a peer fusion system, its table and
classification on synthetic decisions (no vLLM needed), our side on a tiny llama, and (only
where vLLM is importable: the peer environment of scripts/vllm_peer.sh) vLLM's side."""

from __future__ import annotations

import configparser
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fusion
from harness.peers import vllm as peer
from harness.peers.agreement import (
    CATEGORIES,
    ArchComparison,
    Decision,
    Disagreement,
    Rule,
    category_counts,
    classify,
    compare,
    grouped,
    report_json,
    table,
    total,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not importable here (peer environment: scripts/vllm_peer.sh)"
)


def _d(family: str, qualname: str, detail: str = "", cls: str = "C") -> Decision:
    return Decision(family, qualname, cls, detail)


def test_compare_counts_each_kind_per_family():
    ours = [
        _d("qkv", "a", "k+q+v"),
        _d("qkv", "b", "k+q+v"),
        _d("glu", "m", "gate+up"),
        _d("residual_norm", "l"),
    ]
    theirs = [
        _d("qkv", "a", "k+q+v"),
        _d("qkv", "b", "k+q"),
        _d("glu", "m", ""),
        _d("attention", "a"),
    ]
    result = compare("x", ours, theirs)
    assert result.counts["qkv"] == {
        "same": 1,
        "peer-only": 0,
        "ours-only": 0,
        "differ": 1,
        "other-family": 0,
    }
    assert result.counts["glu"]["same"] == 1  # an empty detail is not compared
    assert result.counts["attention"]["peer-only"] == 1
    assert result.counts["residual_norm"]["ours-only"] == 1
    kinds = {(d.family, d.qualname): d.kind for d in result.disagreements}
    assert kinds == {
        ("qkv", "b"): "differ",
        ("attention", "a"): "peer-only",
        ("residual_norm", "l"): "ours-only",
    }
    assert all(d.category == "unclassified" for d in result.disagreements)


def test_a_module_only_the_peer_fuses_carries_our_refusal_reasons():
    result = compare("x", [], [_d("glu", "m", "gate+up")], {"m": ["glu: a reason"]})
    (only,) = result.disagreements
    assert only.ours == "glu: a reason" and only.peer == "gate+up"


def test_duplicate_decisions_keep_the_first_and_inputs_are_untouched():
    ours = [_d("qkv", "a", "k+q+v"), _d("qkv", "a", "other")]
    result = compare("x", ours, [_d("qkv", "a", "k+q+v")])
    assert result.counts["qkv"]["same"] == 1 and not result.disagreements
    assert ours[1].detail == "other"


def test_classify_takes_the_first_matching_rule_and_leaves_the_rest_unclassified():
    d = Disagreement("x", "moe", "q", "GptOssMLP", "ours-only", "experts | biased", "")
    rules = (
        Rule("unsafe", "wrong family", family="qkv"),
        Rule("reach-gap-peer", "first", family="moe", module_class="^Gpt", ours="biased"),
        Rule("definition", "second", family="moe"),
    )
    assert classify(d, rules).category == "reach-gap-peer"
    assert classify(d, rules).explanation == "first"
    assert classify(d, rules[:1]) == d
    assert not Rule("definition", "", peer="something").matches(d)
    assert Rule("definition", "", kind="ours-only", peer="^$").matches(d)


def test_totals_table_categories_and_groups():
    rules = (Rule("definition", "why", family="attention"),)
    one = compare("a1", [_d("qkv", "q", "k+q+v")], [_d("qkv", "q", "k+q+v"), _d("attention", "q")])
    two = compare("a2", [], [_d("attention", "q"), _d("attention", "r")], rules=rules)
    broken = ArchComparison("a3", error="build: BuildError: no")
    sums = total([one, two, broken])
    assert list(sums) == ["qkv", "attention"]  # table order, not arrival order
    assert sums["attention"]["peer-only"] == 3
    rendered = table(sums, "vLLM")
    header = "| family | same | vLLM only | ours only | differ | other family |"
    assert rendered.splitlines()[0] == header
    assert "| attention | 0 | 3 | 0 | 0 | 0 |" in rendered
    assert rendered.splitlines()[-1] == "| **total** | 1 | 3 | 0 | 0 | 0 |"
    counts = category_counts([one, two])
    assert list(counts) == list(CATEGORIES)
    assert counts["definition"] == 2 and counts["unclassified"] == 1
    groups = grouped([one, two])
    assert [g["category"] for g in groups] == ["definition", "unclassified"]
    assert groups[0]["archs"] == ["a2"] and groups[0]["qualnames"] == ["a2:q", "a2:r"]
    data = json.loads(json.dumps(report_json([one, two, broken], {"vllm": "0"})))
    assert data["vllm"] == "0" and data["architectures"][2]["error"].startswith("build")


@pytest.mark.parametrize(
    ("family", "description", "detail"),
    [
        ("qkv", "q_proj + k_proj + v_proj -> qkv_proj", "k_proj+q_proj+v_proj"),
        (
            "glu",
            "gate_proj + up_proj -> gate_up_proj, act_fn(*) * -> act_and_mul",
            "gate_proj+up_proj",
        ),
        ("mla", "q_a_proj + kv_a_proj_with_mqa -> fused_qkv_a_proj", "kv_a_proj_with_mqa+q_a_proj"),
        ("moe", "gate: linear -> softmax -> top-2; experts[packed] grouped -> FusedMoE", "block"),
        ("moe", "experts: gate program ... -> FusedExperts (experts alone; ...)", "experts"),
        ("rms_norm", "-> FusedRMSNorm (float32 statistics)", ""),
        ("qkv", "something else entirely", ""),
    ],
)
def test_our_details_are_parsed_from_the_descriptions(family, description, detail):
    assert peer._our_detail(family, description) == detail


@pytest.mark.parametrize(
    ("family", "kind", "cls", "ours", "theirs", "category"),
    [
        ("attention", "peer-only", "LlamaAttention", "", "AttentionFuser", "definition"),
        ("packed_qkv", "peer-only", "GPTBigCodeAttention", "", "PackedQKVFuser", "definition"),
        ("residual_norm", "ours-only", "LlamaDecoderLayer", "residual add", "", "definition"),
        ("decode_linear", "ours-only", "Linear", "decode-sized products", "", "definition"),
        (
            "moe",
            "ours-only",
            "GptOssMLP",
            "experts | experts: gate program ..., transposed, biased -> FusedExperts",
            "",
            "reach-gap-peer",
        ),
        (
            "moe",
            "differ",
            "AriaTextMoELayer",
            "experts | experts: silu(gate) * up, transposed -> FusedExperts (experts alone; the "
            "block: experts is_transposed=True (need False))",
            "block | MoEBlockFuser(gate_name='router', scoring_func='softmax')",
            "reach-gap-ours",
        ),
        ("qkv", "peer-only", "NewAttention", "qkv: refused", "k+q+v", "unclassified"),
    ],
)
def test_the_rules_classify_the_known_disagreements(family, kind, cls, ours, theirs, category):
    d = Disagreement("arch", family, "m", cls, kind, ours, theirs)
    assert classify(d, peer.RULES).category == category


def test_our_side_on_a_tiny_llama(llama):
    decisions, refusals = peer.our_decisions(llama)
    by_family = {}
    for d in decisions:
        by_family.setdefault(d.family, []).append(d)
    assert {d.detail for d in by_family["qkv"]} == {"k_proj+q_proj+v_proj"}
    assert {d.detail for d in by_family["glu"]} == {"gate_proj+up_proj"}
    assert len(by_family["rms_norm"]) == 2 * len(by_family["qkv"]) + 1
    assert isinstance(refusals, dict)
    assert not hasattr(llama.model.layers[0].self_attn, "qkv_proj")  # a dry run


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is importable here")
def test_the_command_says_when_vllm_is_missing(capsys):
    assert peer.main(["--arch", "llama"]) == 2
    assert "vLLM is not importable" in capsys.readouterr().err


@needs_vllm
def test_vllm_and_ours_agree_on_llama_but_for_definitions(tmp_path):
    result = peer.compare_arch("llama")
    assert not result.error
    assert result.counts["qkv"]["same"] == result.counts["glu"]["same"] == 2
    assert result.counts["rms_norm"]["same"] == 5
    assert {d.category for d in result.disagreements} == {"definition"}
    out = tmp_path / "peer.json"
    assert peer.main(["--arch", "llama", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["vllm"]


def _normal(name: str) -> str:
    """A package name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    """{package (PEP 503 name): version} of a constraints file."""
    return {
        _normal(line.split("==")[0]): line.split("==")[1].strip()
        for line in path.read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


@pytest.mark.parametrize(
    ("env_name", "constraints", "vllm", "newest_transformers"),
    [
        ("vllm-peer", "vllm-peer.txt", "0.34.0", "5.22"),  # 0.34.0: transformers <5.23
        ("vllm-peer-033", "vllm-peer-0.33.txt", "0.33.0", "5.20"),  # 0.33.0: <5.21
    ],
)
def test_the_script_and_the_tox_env_install_the_same_pinned_packages(
    env_name, constraints, vllm, newest_transformers
):
    """scripts/vllm_peer.sh and tox -e vllm-peer(-033): one package list, every package
    pinned by the env's constraints file, which alone names the vLLM release and a
    Transformers that release accepts."""
    repo = Path(__file__).resolve().parents[3]
    script = (repo / "scripts" / "vllm_peer.sh").read_text()
    block = re.search(r"PEER_DEPS=\(\n(.*?)\n\)", script, re.S)
    assert block is not None
    from_script = set(block.group(1).split()) | {"torch==2.13.0"}
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(repo / "tox.ini")
    env = tox[f"testenv:{env_name}"]
    deps = tox["testenv:vllm-peer"]["deps"] if "{[" in env["deps"] else env["deps"]
    assert set(deps.split()) == from_script
    assert f"constraints/{constraints}" in env["setenv"]
    pre = tox["testenv:vllm-peer"]["commands_pre"]
    assert "--no-deps vllm" in pre and "--no-deps vllm" in script
    assert "vllm-peer.txt" in script and "VLLM_PEER_CONSTRAINTS" in script
    pins = _pins(repo / "constraints" / constraints)
    assert pins["vllm"] == vllm
    line = ".".join(pins["transformers"].split(".")[:2])
    assert _version(line) <= _version(newest_transformers), pins["transformers"]
    for package in from_script:
        assert _normal(package.split("==")[0]) in pins, package


def test_other_family_pairs_one_merge_filed_under_two_families():
    """GPT-J: vLLM's QKV fuser and our sibling fuser merge the same q/k/v: one entry."""
    ours = [_d("merged_column", "attn", "k+q+v"), _d("glu", "mlp", "w1+w3")]
    theirs = [_d("qkv", "attn", "k+q+v"), _d("merged_column", "mlp", "w1+w3")]
    result = compare("gptj", ours, theirs, rules=peer.RULES)
    assert result.counts["qkv"]["other-family"] == 1
    assert result.counts["merged_column"]["other-family"] == 1
    assert "merged_column" not in result.counts or not result.counts["merged_column"]["ours-only"]
    by_family = {d.family: d for d in result.disagreements}
    assert by_family["qkv"].ours.startswith("as merged_column: ")
    assert by_family["qkv"].category == "definition"
    assert by_family["merged_column"].category == "reach-gap-peer"
    # different projections are not paired
    apart = compare("git", [_d("merged_column", "a", "k+q")], [_d("qkv", "a", "k+q+v")])
    assert apart.counts["qkv"]["peer-only"] == apart.counts["merged_column"]["ours-only"] == 1


# The hazards behind the `unsafe` disagreements, built small. Each shows what vLLM's rewrite
# computes where our analysis refuses it.


class _Projections(nn.Module):
    """Three projections of one input, summed: the shape our sibling fuser merges."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) * self.k_proj(x) + self.v_proj(x)


class _SharedBlockTwice(nn.Module):
    """Zamba's shape: one block of Parameters called by two layers (tied when `tied`)."""

    def __init__(self, tied: bool):
        super().__init__()
        first = [nn.Linear(8, 8) for _ in range(3)]
        second = [nn.Linear(8, 8) for _ in range(3)]
        if tied:  # other modules, the same Parameters (as Zamba's checkpoint ties them)
            for mine, theirs in zip(second, first):
                mine.weight, mine.bias = theirs.weight, theirs.bias
        self.first, self.second = _Projections(*first), _Projections(*second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_hazard_tied_parameters_a_copying_merge_unties_them():
    """vLLM's merge allocates a fresh stacked weight per layer (MergedColumnParallelLinear,
    filled from the checkpoint): here `torch.cat` of the shards. After an in-place update of
    the tied Parameters (an optimizer step, load_state_dict, a weight edit) the unmerged user
    sees it and the merged copy does not: the two layers stop sharing weights. Our engine
    refuses the merge (and merges the untied twin)."""
    torch.manual_seed(0)
    model = _SharedBlockTwice(tied=True)
    block = model.first
    stacked = torch.cat([block.q_proj.weight, block.k_proj.weight, block.v_proj.weight]).detach()
    bias = torch.cat([block.q_proj.bias, block.k_proj.bias, block.v_proj.bias]).detach()

    def merged_first(x: torch.Tensor) -> torch.Tensor:  # what vLLM's rewritten forward runs
        q, k, v = torch.nn.functional.linear(x, stacked, bias).split(8, -1)
        return q * k + v

    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(merged_first(x), block(x))
        block.q_proj.weight.add_(1.0)  # one update of the tied Parameter
        assert torch.allclose(model.second(x), block(x))  # the unmerged user sees it
        assert not torch.allclose(merged_first(x), block(x))  # the merged copy does not

    refused = fusion.plan(_SharedBlockTwice(tied=True))
    assert not refused.applied
    assert any("tied" in s.reason for s in refused.skipped)
    assert {a.qualname for a in fusion.plan(_SharedBlockTwice(tied=False)).applied} == {
        "first",
        "second",
    }


def _clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4 / HY-V4 experts' own gating (`_apply_gate`): split, clamp both, silu * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """FusedMoE's activation 'silu' (vLLM's SiluAndMul): silu(gate) * up, nothing clamped."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_hazard_experts_with_their_own_gating_under_a_plain_silu_kernel():
    """vLLM swaps `experts` holding 3-D parameters for FusedMoE with activation 'silu' (the
    Transformers backend's default). On experts whose gating clamps (limit 7 here, as
    DeepSeek-V4's swiglu_limit) the swap agrees while activations stay under the limit and
    differs once they pass it; our engine refuses the block's FusedMoE for these experts and
    replays their gating op for op."""
    small = torch.linspace(-3, 3, 16).reshape(2, 8)
    large = small * 10
    assert torch.equal(_clamped_swiglu(small, 7.0), _silu_and_mul(small))
    assert not torch.allclose(_clamped_swiglu(large, 7.0), _silu_and_mul(large))
    if HAS_VLLM:  # vLLM's own kernel, native path, where the peer environment has it
        from vllm.model_executor.layers.activation import SiluAndMul

        # a staticmethod: no CustomOp built (vLLM 0.34 builds one only under a VllmConfig)
        assert torch.allclose(SiluAndMul.forward_native(large), _silu_and_mul(large))
