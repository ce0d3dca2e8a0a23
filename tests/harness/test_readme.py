"""README.md and docs/*.md: their Python examples run as written, the README stays short with
both commands on its first screen, and the layout in docs/development.md matches the packages."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""Every page whose fenced `python` blocks must run as written. A block that cannot run in a
CPU test (a GPU, the network, a real model) is fenced as something else (`text`, `bash`,
`python-gpu`), with the reason in the text around it."""

COMMANDS = (
    "pip install . && fusion-harness run",
    "pip install -c constraints/ci.txt -e '.[test]' && python -m pytest -n auto",
)
"""The two commands a newcomer needs: run the main job; pass the tests."""

ROOTS = {"fusion": "fusion/engine", "harness": "harness/cli", "corpus": "corpus"}
"""Each root whose package directories the layout must name, with a directory that exists once
that root's package-level layout (issue 47) has landed in this tree."""

LAYOUT_PAGE = REPO / "docs" / "development.md"


def _blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of `text` in `language` ("" for blocks without one)."""
    blocks, current, lang = [], None, ""
    for line in text.splitlines(keepends=True):
        if line.startswith("```") and current is None:
            current, lang = [], line[3:].strip()
        elif line.startswith("```"):
            if lang == language:
                blocks.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _python_examples() -> list:
    """One pytest parameter per fenced `python` block of every page, named page-N."""
    params = []
    for page in PAGES:
        for n, code in enumerate(_blocks(page.read_text(encoding="utf-8"), "python")):
            name = page.relative_to(REPO).as_posix()
            params.append(pytest.param(name, code, id=f"{name}-{n}"))
    return params


def _layout() -> str:
    """The package-level layout block of docs/development.md (the one starting with fusion/)."""
    text = LAYOUT_PAGE.read_text(encoding="utf-8")
    (tree,) = [b for b in _blocks(text, "text") if b.startswith("fusion/")]
    return tree


def _named_paths(tree: str) -> set[str]:
    """The paths in the layout's first column (lines starting without indentation)."""
    named = set()
    for line in tree.splitlines():
        if not line or line[0].isspace():  # a description's continuation line
            continue
        first = re.split(r"\s{2,}", line.strip())[0]
        named.update(name.strip() for name in first.split(","))
    return named


def _package_dirs(root: str) -> set[str]:
    """Every directory under `root` (itself included) but caches, as `path/`."""
    base = REPO / root
    dirs = {f"{root}/"}
    for child in base.rglob("*"):
        if child.is_dir() and "__pycache__" not in child.parts:
            dirs.add(f"{child.relative_to(REPO).as_posix()}/")
    return dirs


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


@pytest.mark.parametrize(("page", "code"), _python_examples())
def test_python_examples_run_as_written(page, code, tmp_path, monkeypatch, own_cache):
    """Before: the Usage snippet used `model`, `fused` and `unfused_checkpoint` undefined."""
    monkeypatch.chdir(tmp_path)
    exec(compile(code, page, "exec"), {"__name__": "__readme__"})


def test_the_readme_is_short_with_both_commands_on_its_first_screen():
    """Before: 1,625 lines, 427 of them benchmark logs; the two commands hard to find."""
    lines = README.splitlines()
    assert len(lines) <= 320, f"README.md has {len(lines)} lines: move detail to docs/"
    first_screen = "\n".join(lines[:60])
    for command in COMMANDS:
        assert command in first_screen, f"README's first 60 lines lack `{command}`"


def test_the_install_block_gets_the_cpu_torch_first():
    """Before: `pip install .` first, which pulls the 5.6 GB CUDA build on a CPU machine."""
    (setup,) = [b for b in _blocks(README, "bash") if "pip install ." in b]
    commands = [line for line in setup.splitlines() if not line.startswith("#")]
    assert "--index-url https://download.pytorch.org/whl/cpu" in commands[0]
    assert commands[1].startswith("pip install . ")
    assert "python -m pytest -n auto" in setup


def test_links_between_pages_reach_a_page_that_exists():
    """A section moved out of the README leaves no link to an anchor or page that is gone."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "#")):
                continue
            path = target.split("#")[0]
            assert (page.parent / path).exists(), f"{page.name} links to {target}"
    assert "DESIGN.md" not in README


@pytest.mark.parametrize("root", sorted(ROOTS))
def test_the_layout_names_every_package_and_only_existing_ones(root):
    """Before: the README's layout named every file, so every file move broke it; now one line
    per package directory, in docs/development.md."""
    named = {p for p in _named_paths(_layout()) if p.startswith(f"{root}/")}
    existing = _package_dirs(root)
    assert existing - named == set(), f"docs/development.md's layout lacks {existing - named}"
    assert named - existing == set(), f"docs/development.md's layout names {named - existing}"


def test_times_quoted_say_the_machine_and_load():
    """Every "N min" or "N s" figure sits in a paragraph naming the machine ("core") and load."""
    for page in PAGES:
        for paragraph in re.split(r"\n\s*\n", page.read_text(encoding="utf-8")):
            if re.search(r"\b\d+(\.\d+)?(-\d+)? ?(min|s)\b", paragraph) and "```" not in paragraph:
                assert "core" in paragraph and ("quiet" in paragraph or "load" in paragraph), (
                    page.name,
                    paragraph,
                )
