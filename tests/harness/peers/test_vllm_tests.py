"""harness.peers.vllm_tests and its plugin harness.peers.vllm_mapping: vLLM-style test files
run against our engine with no vLLM installed, every outcome recorded and classified.

The test files here are written for the test (vLLM's own come from its sdist at run time,
`python -m harness.peers.vllm_tests`, which needs the network once); the plugin runs in a
subprocess, so its stand-in `vllm` never reaches this process's imports."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import tarfile
import textwrap
from pathlib import Path

import pytest

from harness.peers import vllm_tests

VLLM_STYLE = """
import pytest
import torch
from torch import nn

from vllm.model_executor.layers.layernorm import RMSNorm as VLLMRMSNorm
from vllm.model_executor.models.transformers.fuser import get_fuser
from vllm.model_executor.models.transformers.fusers import MoEBlockFuser, RMSNormFuser


class Norm(nn.Module):
    def __init__(self, hidden=16, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class Centred(Norm):
    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.randn(4, 32, 16))
        self.down_proj = nn.Parameter(torch.randn(4, 16, 16))

    def forward(self, x, index, weight):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.where(index == e)
            gate, up = (x[rows] @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            hit = (torch.nn.functional.silu(gate) * up) @ self.down_proj[e].T
            out.index_add_(0, rows, hit * weight[rows, slot, None])
        return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 4)
        self.experts = Experts()

    def forward(self, x):
        weight, index = torch.topk(self.gate(x).softmax(-1), 2)
        return self.experts(x, index, weight)


def test_detects_a_norm():
    assert isinstance(get_fuser(Norm(), RMSNormFuser), RMSNormFuser)


def test_a_centred_norm_is_not_matched():
    assert get_fuser(Centred(), RMSNormFuser) is None


def test_fused_norm_computes_the_same():
    module = Norm()
    built = get_fuser(module, RMSNormFuser).fuse(module, "norm", None)
    x = torch.randn(3, 16)
    torch.testing.assert_close(built(x), module(x))


def test_a_plain_norm_is_not_zero_centred():
    assert get_fuser(Norm(), RMSNormFuser).zero_centered is False


def test_the_built_norm_reads_eps_as_vllm_names_it():
    module = Norm(eps=1e-5)
    assert get_fuser(module, RMSNormFuser).fuse(module, "norm", None).variance_epsilon == 1e-5


def test_builds_the_vllm_class():
    module = Norm()
    assert isinstance(get_fuser(module, RMSNormFuser).fuse(module, "n", None), VLLMRMSNorm)


def test_a_custom_experts_block_is_matched():
    assert isinstance(MoEBlockFuser.match(Block(), "experts"), MoEBlockFuser)


def test_wants_a_config(default_vllm_config):
    assert default_vllm_config.model_config.dtype == torch.float32
"""


def _tree(root: Path) -> Path:
    target = root / "tree"
    for init in ("tests", "tests/models", "tests/models/transformers", vllm_tests.TEST_DIR):
        (target / init).mkdir(parents=True, exist_ok=True)
        (target / init / "__init__.py").write_text("")
    (target / vllm_tests.TEST_DIR / "test_norms.py").write_text(textwrap.dedent(VLLM_STYLE))
    return target


def test_each_test_ends_pass_fail_or_not_mapped_and_fails_are_classified(tmp_path):
    outcomes = vllm_tests.classify(vllm_tests.run_tests(_tree(tmp_path)))
    by_name = {o["test"].rsplit("::", 1)[-1]: o for o in outcomes}
    assert {name: o["outcome"] for name, o in by_name.items()} == {
        "test_detects_a_norm": "pass",
        "test_a_centred_norm_is_not_matched": "pass",
        "test_fused_norm_computes_the_same": "pass",
        # the norm fused as a kept module with fusion's installed forward (NormForward) still
        # answers vLLM's questions: its variant's offset, eps where its forward reads it
        "test_a_plain_norm_is_not_zero_centred": "pass",
        "test_the_built_norm_reads_eps_as_vllm_names_it": "pass",
        "test_builds_the_vllm_class": "not-mapped",
        "test_a_custom_experts_block_is_matched": "fail",
        "test_wants_a_config": "pass",
    }
    assert (
        "vllm.model_executor.layers.layernorm.RMSNorm"
        in by_name["test_builds_the_vllm_class"]["detail"]
    )
    experts = by_name["test_a_custom_experts_block_is_matched"]
    assert "Experts is not a Transformers experts-interface" in experts["ours"]
    assert experts["category"] == "ours refuses by design"
    lines = vllm_tests.table(outcomes)
    assert lines[1].split() == ["test_norms.py", "6", "1", "1", "0"]


def test_an_unmatched_fail_is_unclassified_and_fails_the_run():
    outcomes = vllm_tests.classify(
        [{"test": "t.py::test_x", "file": "t.py", "outcome": "fail", "detail": "", "ours": "?"}]
    )
    assert outcomes[0]["category"] == "unclassified"
    assert any("unclassified: t.py::test_x" in line for line in vllm_tests.table(outcomes))


def _archive(tmp_path: Path, members: dict[str, bytes]) -> Path:
    path = tmp_path / f"vllm-{vllm_tests.VERSION}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return path


def test_only_the_fuser_tests_and_their_package_inits_are_read(tmp_path):
    root = f"vllm-{vllm_tests.VERSION}/"
    archive = _archive(
        tmp_path,
        {
            root + vllm_tests.TEST_DIR + "/test_a.py": b"x = 1\n",
            root + vllm_tests.TEST_DIR + "/nested/test_b.py": b"",
            root + "tests/__init__.py": b"",
            root + "tests/conftest.py": b"import vllm\n",
            root + "setup.py": b"",
            "elsewhere/" + vllm_tests.TEST_DIR + "/test_c.py": b"",
        },
    )
    assert sorted(vllm_tests.test_files(archive)) == [
        "tests/__init__.py",
        vllm_tests.TEST_DIR + "/test_a.py",
    ]


def test_an_archive_with_another_hash_is_refused_and_nothing_cached(tmp_path):
    members = {f"vllm-{vllm_tests.VERSION}/{vllm_tests.TEST_DIR}/test_a.py": b"x = 1\n"}
    fake = _archive(tmp_path, members)

    def download(dest: Path, sdist: vllm_tests.Sdist) -> Path:
        return Path(dest / fake.name).write_bytes(fake.read_bytes()) and dest / fake.name

    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="sha256"):
        vllm_tests.ensure_tests(cache, download=download)
    assert not (cache / f"vllm-{vllm_tests.VERSION}").exists()
    digest = hashlib.sha256(fake.read_bytes()).hexdigest()
    sdist = dataclasses.replace(vllm_tests.SDISTS[vllm_tests.VERSION], sha256=digest)
    tree = vllm_tests.ensure_tests(cache, download=download, sdist=sdist)
    assert (tree / vllm_tests.TEST_DIR / "test_a.py").read_text() == "x = 1\n"


def test_the_default_release_is_the_pinned_peer_and_every_release_names_its_archive():
    """The tests run by default are those of the vLLM that constraints/vllm-peer.txt pins;
    every release's URL ends in its own archive name and carries a full sha256."""
    repo = Path(__file__).resolve().parents[3]
    pins = (repo / "constraints" / "vllm-peer.txt").read_text().splitlines()
    assert f"vllm=={vllm_tests.VERSION}" in pins
    assert {"0.33.0", "0.34.0"} <= set(vllm_tests.SDISTS)
    for version, sdist in vllm_tests.SDISTS.items():
        assert sdist.version == version
        assert sdist.url.endswith(f"/vllm-{version}.tar.gz")
        assert len(sdist.sha256) == 64 and int(sdist.sha256, 16) >= 0
