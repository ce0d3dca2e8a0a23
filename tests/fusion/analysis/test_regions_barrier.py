"""`fusion.analysis.regions`' region barrier as a pure function of a forward's source: where a
state change counts as between two calls, and generated programs of nested blocks and
global-state toggles, each run with its projections moved to the merge point, so every
refusal is a real hazard and every acceptance computes the same.
"""

from __future__ import annotations

import ast
import copy
import textwrap
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusion.analysis import source
from fusion.analysis.regions import (
    StateProof,
    region_barrier,
)
from fusion.trace.tracer import preserved_globals


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Every hazard forward restores what it sets; this guards the other tests if one does
    not (a failing assertion midway)."""
    with preserved_globals():
        yield


def test_a_state_call_after_the_last_call_in_its_branch_is_not_between() -> None:
    # Gemma 4's shape: k and v in an `else` branch followed by a cache update; what runs
    # after the last projection is not moved across by the merge.
    funcdef = _parse(
        """
        def forward(self, h):
            q = self.p0(h)
            if self.shared:
                k, v = self.shared_kv
            else:
                k = self.p1(h)
                v = self.p2(h)
                torch.set_grad_enabled(False)
            return q, k, v
        """
    )
    assert _reason(funcdef) is None
    funcdef = _parse(
        """
        def forward(self, h):
            q = self.p0(h)
            if self.shared:
                torch.set_grad_enabled(False)
            else:
                k = self.p1(h)
                v = self.p2(h)
            return q
        """
    )
    # The `if` branch runs instead of the calls, never before them: still nothing between.
    assert _reason(funcdef) is None
    funcdef = _parse(
        """
        def forward(self, h):
            q = self.p0(h)
            if torch.set_grad_enabled(False) is None:
                k = self.p1(h)
                v = self.p2(h)
            return q
        """
    )
    assert "torch.set_grad_enabled(False)" in (_reason(funcdef) or "")


def test_a_call_around_the_last_call_runs_after_it() -> None:
    # Inkling's `self.k_sconv(self.k_proj(x))` as the last merged call: the outer call takes
    # effect after the projection ran. An argument evaluated before it still counts.
    after = """
        def forward(self, h):
            q = self.p0(h)
            k = self.p1(h)
            v = torch.set_grad_enabled(self.p2(h).sum() > 0)
            return q
        """
    assert _reason(_parse(after)) is None
    before = """
        def forward(self, h):
            q = self.p0(h)
            k = self.p1(h)
            v = torch.cat([torch.set_grad_enabled(False), self.p2(h)])
            return q
        """
    assert "between p1 and p2" in (_reason(_parse(before)) or "")


# -- the pure function, by execution ----------------------------------------------------

KINDS = ("no_grad", "enable_grad", "unknown", "if")
HEADERS = {
    "no_grad": "with torch.no_grad():",
    "enable_grad": "with torch.enable_grad():",
    "unknown": "with ctx():",
    "if": "if h is not None:",
}
LEAVES = {"pure": "t = h.sum()", "flip": "flip()"}


@dataclass
class Block:
    """A generated block: statements, each a leaf name, a call index, or a nested block."""

    kind: str
    body: list[Any] = field(default_factory=list)


def _blocks(depth: int = 0) -> st.SearchStrategy[list[Any]]:
    leaf = st.sampled_from(sorted(LEAVES))
    if depth >= 2:
        return st.lists(leaf, max_size=3)
    nested = st.builds(Block, st.sampled_from(KINDS), st.deferred(lambda: _blocks(depth + 1)))
    return st.lists(st.one_of(leaf, nested), max_size=3)


def _slots(body: list[Any]) -> list[tuple[list[Any], int]]:
    slots = [(body, index) for index in range(len(body) + 1)]
    for item in body:
        if isinstance(item, Block):
            slots += _slots(item.body)
    return slots


@st.composite
def programs(draw: Any) -> list[Any]:
    """A forward body holding three projection calls (numbered `self.p0(h)`, `self.p1(h)`,
    `self.p2(h)` in source order when rendered) among `with` blocks (known and unknown
    managers), `if`s, pure statements and calls of a global-state setter the proof cannot
    read (`flip()`)."""
    body = copy.deepcopy(draw(_blocks()))
    for _ in range(3):
        slots = _slots(body)
        target, index = slots[draw(st.integers(0, len(slots) - 1))]
        target.insert(index, 0)
    return body


def _render(body: list[Any], indent: int = 1) -> list[str]:
    lines: list[str] = []
    pad = "    " * indent
    for item in body or ["pass"]:
        if isinstance(item, Block):
            lines.append(pad + HEADERS[item.kind])
            lines += _render(item.body, indent + 1)
        elif isinstance(item, int):
            lines.append(pad + "r = self.p{}(h)")
        else:
            lines.append(pad + LEAVES.get(item, item))
    return lines


def _program_source(body: list[Any]) -> str:
    lines = _render(body)
    numbered, count = [], 0
    for line in lines:
        if "self.p{}" in line:
            line, count = line.format(count), count + 1
        numbered.append(line)
    return "def forward(self, h):\n" + "\n".join(numbered) + "\n    return None\n"


class Recorder:
    """`self` of a generated forward: each call records the state it runs in."""

    def __init__(self, state: Any) -> None:
        self.state, self.seen = state, []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.seen.append(self.state())


def _parse(text: str) -> ast.FunctionDef:
    funcdef = ast.parse(textwrap.dedent(text)).body[0]
    assert isinstance(funcdef, ast.FunctionDef)
    return funcdef


def _calls(funcdef: ast.FunctionDef) -> list[ast.Call]:
    return [source.self_call_and_refs(funcdef, f"p{i}")[0] for i in range(3)]


def _reason(funcdef: ast.FunctionDef) -> str | None:
    barrier = region_barrier(funcdef, _calls(funcdef), _proof(funcdef))
    return None if barrier is None else barrier.reason


def _proof(funcdef: ast.FunctionDef, namespace: dict[str, Any] | None = None) -> StateProof:
    return StateProof.of(funcdef, None, namespace or {"torch": torch})


@settings(max_examples=300, deadline=None)
@given(programs())
def test_region_hazard_by_execution(body: list[Any]) -> None:
    """Sound: when `region_barrier` accepts, every call ran in the state of the merge point
    (grad mode, the stack of unknown managers, the count of state changes). Not
    over-cautious: without state setters or unknown managers, and with every `with` around
    all calls or none, it accepts."""
    text = _program_source(body)
    funcdef = _parse(text)
    calls = _calls(funcdef)
    flips, stack = [0], []

    class Ctx:
        def __enter__(self) -> None:
            stack.append(len(stack))

        def __exit__(self, *exc: object) -> None:
            stack.pop()

    def flip() -> None:
        flips[0] += 1

    namespace: dict[str, Any] = {"torch": torch, "ctx": Ctx, "flip": flip}
    barrier = region_barrier(funcdef, calls, _proof(funcdef, namespace))
    reason = None if barrier is None else barrier.reason
    # Execute the program with `self.mark()` at the merge point.
    block, indices = source.dominating_block(funcdef, calls)
    block.insert(min(indices), ast.parse("self.mark()").body[0])
    module = ast.fix_missing_locations(ast.Module(body=[funcdef], type_ignores=[]))
    exec(compile(module, "<generated>", "exec"), namespace)
    recorder = Recorder(lambda: (torch.is_grad_enabled(), tuple(stack), flips[0]))
    with torch.enable_grad():
        namespace["forward"](recorder, torch.zeros(2))
    mark, *seen = recorder.seen
    if reason is None:
        assert all(state == mark for state in seen), text
    withs = [n for n in ast.walk(funcdef) if isinstance(n, ast.With)]
    partial = any(0 < sum(source.contains(w, c) for c in calls) < 3 for w in withs)
    if "flip()" not in text and "ctx()" not in text and not partial:
        assert reason is None, (text, reason)
