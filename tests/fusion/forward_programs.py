"""Generated forwards as programs (`tests/fusion/forward_grammar.py` is the grammar): the
`programs` strategy, the region a merged projection would hoist over (`Program.region`), the
module the analysis judges (`TwoProjections`), and running a program to see whether its input
really changed (`run`, `unchanged`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from tests.fusion.forward_grammar import IN_FEATURES, Gen, TensorVar


@dataclass(frozen=True)
class Program:
    source: str

    def funcdef(self) -> ast.FunctionDef:
        node = ast.parse(self.source).body[0]
        assert isinstance(node, ast.FunctionDef)
        return node

    @staticmethod
    def region(funcdef: ast.FunctionDef) -> tuple[ast.expr, list[ast.stmt]]:
        """The input expression of `self.p1(x)` and the statements from that call to
        `self.p2(x)`, inclusive: what a merged projection would hoist over."""
        marks = [
            index
            for index, stmt in enumerate(funcdef.body)
            if isinstance(stmt, ast.Assign)
            and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id in ("_r1", "_r2")
        ]
        first, second = marks
        call = funcdef.body[first].value
        assert isinstance(call, ast.Call)
        return call.args[0], funcdef.body[first : second + 1]

    def __repr__(self) -> str:  # shown by Hypothesis on failure: the program itself
        return "\n" + self.source


@st.composite
def programs(draw: Any, max_statements: int = 4) -> Program:
    """A forward of up to `max_statements` statements before, between and after the calls."""
    gen = Gen(draw)
    body: list[list[str]] = []
    for _ in range(draw(st.integers(0, max_statements))):
        body.append(gen.statement())
    body.append(["_r1 = self.p1(x)"])
    for _ in range(draw(st.integers(0, max_statements))):
        body.append(gen.statement())
    if not (isinstance(gen.env.get("x"), TensorVar) and gen.env["x"].projectable):
        # A region statement rebound `x` to something `p2` cannot read; put it back.
        body.append(["x = torch.zeros(4, 4, dtype=torch.float64)"])
    body.append(["_r2 = self.p2(x)"])
    for _ in range(draw(st.integers(0, 2))):
        body.append(gen.statement())
    lines = ["def forward(self, x):"]
    for statement in body:
        lines += [f"    {line}" for line in statement]
    lines.append("    return _r1, _r2")
    return Program("\n".join(lines) + "\n")


class Recorder(nn.Linear):
    """A linear that records a copy of each input it is called on (execution only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[torch.Tensor] = []

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self.seen.append(input.detach().clone())
        return super().forward(input)


class TwoProjections(nn.Module):
    """The module the analysis judges: plain `nn.Linear` children, as in a real model."""

    def __init__(self, linear: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        kw = dict(dtype=torch.float64)
        self.p1 = linear(IN_FEATURES, 3, **kw)
        self.p2 = linear(IN_FEATURES, 3, **kw)
        self.p3 = nn.Linear(IN_FEATURES, IN_FEATURES, **kw)


NAMESPACE: dict[str, Any] = {
    "torch": torch,
    "F": F,
    "nn": nn,
    "operator": __import__("operator"),
    "contextlib": __import__("contextlib"),
}


def run(program: Program, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Execute `program` on a float64 input; the inputs `p1` and `p2` saw, or None when the
    program raised before `p2` ran (the generator aims never to let that happen)."""
    namespace = dict(NAMESPACE)
    exec(compile(program.source, "<generated forward>", "exec"), namespace)
    module = TwoProjections(Recorder)
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    try:
        with torch.no_grad():
            namespace["forward"](module, x)
    except Exception:
        pass
    if len(module.p1.seen) != 1 or len(module.p2.seen) != 1:
        return None
    return module.p1.seen[0], module.p2.seen[0]


def unchanged(before: torch.Tensor, after: torch.Tensor) -> bool:
    return before.shape == after.shape and bool(
        torch.equal(before.isnan(), after.isnan())
        and torch.equal(before.nan_to_num(), after.nan_to_num())
    )
