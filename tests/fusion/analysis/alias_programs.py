"""Programs the alias tests judge and run: a forward with two projections around a region
(`program`), the analysis' verdict on it (`judged_stable`), whether running it really changes
the input (`actually_changes`), and parsing helpers.
"""

from __future__ import annotations

import ast
import textwrap

from torch import nn

from fusion.analysis.alias import check_input_stable
from fusion.errors import RewriteRefused
from tests.fusion.forward_programs import Program, TwoProjections, run, unchanged


def program(pre: str = "", mid: str = "", post: str = "", args: str = "x") -> Program:
    """`def forward(self, <args>)` with `_r1 = self.p1(x)` and `_r2 = self.p2(x)` around
    `mid`; each part is an indented block of statements (dedented here)."""

    def block(text: str) -> list[str]:
        return [f"    {line}" for line in textwrap.dedent(text).strip("\n").splitlines()]

    lines = [f"def forward(self, {args}):", *block(pre), "    _r1 = self.p1(x)", *block(mid)]
    lines += ["    _r2 = self.p2(x)", *block(post), "    return _r1, _r2"]
    return Program("\n".join(lines) + "\n")


def judged_stable(prog: Program, module: nn.Module | None = None) -> bool:
    funcdef = prog.funcdef()
    expr, region = Program.region(funcdef)
    try:
        check_input_stable(funcdef, module or TwoProjections(), expr, region)
    except RewriteRefused as exc:
        assert str(exc), "a refusal must carry a reason"
        return False
    return True


def actually_changes(prog: Program) -> bool:
    seen = run(prog)
    assert seen is not None, f"the test program itself failed to run:\n{prog.source}"
    return not unchanged(*seen)


def expr(text: str) -> ast.expr:
    node = ast.parse(text, mode="eval").body
    return node


def funcdef_of(body: str) -> ast.FunctionDef:
    source = "def forward(self, x):\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node
