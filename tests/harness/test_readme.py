"""README.md: its Python examples run as written and its layout matches the repository."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")

PACKAGES = ("fusion", "fusion/fusers", "fusion/kernels", "corpus", "harness")
"""Directories whose every file (and subpackage) the layout must name."""


def _blocks(language: str) -> list[str]:
    """The fenced code blocks of the README in `language` ("" for blocks without one)."""
    blocks, current, lang = [], None, ""
    for line in README.splitlines(keepends=True):
        if line.startswith("```") and current is None:
            current, lang = [], line[3:].strip()
        elif line.startswith("```"):
            if lang == language:
                blocks.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _layout() -> str:
    (tree,) = [b for b in _blocks("") if b.startswith("fusion/")]
    return tree


def _names(tree: str) -> set[str]:
    """The names in the layout's first column ("qkv.py, glu.py" and "fusion/" included)."""
    names = set()
    for line in tree.splitlines():
        if len(line) - len(line.lstrip()) > 16:  # a description's continuation line
            continue
        first = re.split(r"\s{2,}", line.strip())[0]
        names.update(name.strip() for name in first.split(","))
    return names


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Iterator[None]:
    """A calibration cache of the test's own (the Quick start calls fusion.calibrate), and the
    process's kernel policy as it was afterwards: the measured table must not reach the next
    test in this worker."""
    from fusion.kernels.policy import POLICY

    monkeypatch.setenv("FUSION_HARNESS_CACHE", str(tmp_path / "cache"))
    POLICY.reset()
    yield
    monkeypatch.undo()
    POLICY.reset()


@pytest.mark.parametrize("code", _blocks("python"))
def test_python_examples_run_as_written(code, tmp_path, monkeypatch, own_cache):
    """Before: the Usage snippet used `model`, `fused` and `unfused_checkpoint` undefined."""
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


def test_the_install_block_gets_the_cpu_torch_first():
    """Before: `pip install .` first, which pulls the 5.6 GB CUDA build on a CPU machine."""
    (setup,) = [b for b in _blocks("bash") if "pip install ." in b]
    commands = [line for line in setup.splitlines() if not line.startswith("#")]
    assert "--index-url https://download.pytorch.org/whl/cpu" in commands[0]
    assert commands[1].startswith("pip install . ")
    assert "python -m pytest -n auto" in setup


def test_the_layout_names_every_file_and_only_existing_ones():
    """Before: the README pointed at a DESIGN.md that is not in the repository."""
    assert "DESIGN.md" not in README
    names = _names(_layout())
    for package in PACKAGES:
        for child in (REPO / package).iterdir():
            if child.name in ("__pycache__", "__init__.py") and package != "fusion/kernels":
                continue
            if child.name == "__pycache__":
                continue
            shown = f"{child.name}/" if child.is_dir() else child.name
            assert shown in names, f"README layout lacks {package}/{shown}"
    everything = {p.name for p in REPO.rglob("*") if ".venv" not in p.parts}
    for name in names:
        bare = name.rstrip("/").split("/")[-1]
        assert bare in everything or name.startswith(".ci"), f"README layout names {name}"


def test_times_quoted_say_the_machine_and_load():
    """Every "N min" or "N s" figure sits in a paragraph naming the machine ("core") and load."""
    for paragraph in re.split(r"\n\s*\n", README):
        if re.search(r"\b\d+(\.\d+)?(-\d+)? ?(min|s)\b", paragraph) and "```" not in paragraph:
            assert "core" in paragraph and ("quiet" in paragraph or "load" in paragraph), paragraph
