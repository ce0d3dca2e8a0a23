"""fusion.analysis.source: recover, edit and recompile a forward's source."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers.utils.deprecation import deprecate_kwarg

from fusion.analysis import source
from fusion.errors import RewriteRefused
from tests.fusion.analysis.source_forwards import Plain, find_call, parse_def, passthrough
from tests.fusion.hf_modules import MODULE_NAMES, build_module

# -- recover_forward ---------------------------------------------------------------------------


def opaque(fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:  # no functools.wraps: cannot unwrap
        return fn(*args, **kwargs)

    return wrapper


class Wrapped(Plain):
    @passthrough
    @passthrough
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p(x)


class Deprecated(Plain):
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
        return self.p(x)


class Opaque(Plain):
    @opaque
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p(x)


class UsesSuper(Plain):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return super().forward(x) * 2


def make_closure() -> type[nn.Module]:
    factor = 3.0

    class Closure(Plain):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.p(x) * factor

    return Closure


class LambdaForward(Plain):
    forward = lambda self, x: self.p(x)  # noqa: E731


class Private(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p(x) * self.__scale


class PrivateLocal(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        __tmp = self.p(x)
        return __tmp


class PrivateParameter(Plain):
    def forward(self, x: torch.Tensor, __flag: bool = False) -> torch.Tensor:
        return self.p(x)


class BuiltinForward(nn.Module):
    forward = torch.relu


class AsyncForward(Plain):
    async def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.p(x)


def test_recover_plain_forward_strips_annotations() -> None:
    funcdef, fn = source.recover_forward(Plain)
    assert fn is Plain.forward
    assert funcdef.name == "forward" and funcdef.returns is None
    assert all(arg.annotation is None for arg in funcdef.args.args)
    ann = [n for n in ast.walk(funcdef) if isinstance(n, ast.AnnAssign)]
    assert len(ann) == 1 and isinstance(ann[0].annotation, ast.Constant)
    assert "torch.Tensor" not in source.unparse(funcdef)


@pytest.mark.parametrize("cls", [Wrapped, Deprecated])
def test_recover_unwraps_decorators(cls: type) -> None:
    funcdef, fn = source.recover_forward(cls)
    assert funcdef.decorator_list == []
    assert fn is inspect.unwrap(cls.forward) and fn is not cls.forward
    assert "return self.p(x)" in source.unparse(funcdef)


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (Opaque, "closure"),
        (make_closure(), "closure"),
        (UsesSuper, "closure"),  # `super()` closes over `__class__`
        (LambdaForward, "not a plain function definition"),
        (Private, "name-mangled"),
        (PrivateLocal, "name-mangled"),
        (PrivateParameter, "name-mangled"),
        (BuiltinForward, "not a Python function"),
        (AsyncForward, "not a plain function definition"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_recover_refuses(cls: type, reason: str) -> None:
    with pytest.raises(RewriteRefused, match=reason):
        source.recover_forward(cls)


def test_recover_refuses_when_source_is_unavailable() -> None:
    namespace: dict[str, Any] = {"nn": nn}
    exec("class Generated(nn.Module):\n    def forward(self, x):\n        return x\n", namespace)
    with pytest.raises(RewriteRefused, match="unavailable"):
        source.recover_forward(namespace["Generated"])


class UnindentedString(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        note = """a string whose second line
starts at column zero"""
        return self.p(x) if note else x


def test_recover_forward_with_a_column_zero_string_line() -> None:
    funcdef, _ = source.recover_forward(UnindentedString)
    assert "starts at column zero" in source.unparse(funcdef)


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_recover_every_real_forward(name: str) -> None:
    module = build_module(name)
    funcdef, fn = source.recover_forward(type(module))
    compiled = source.compile_forward(funcdef, fn)
    assert compiled.__code__.co_filename == fn.__code__.co_filename


# -- replace_expr, contains --------------------------------------------------------------------


def test_replace_expr_matches_identity_not_equality() -> None:
    funcdef = parse_def(
        """
        def forward(self, x):
            a = self.p(x)
            b = self.p(x)
            return a + b
        """
    )
    first, second = find_call(funcdef, "p", 0), find_call(funcdef, "p", 1)
    assert ast.dump(first) == ast.dump(second)
    source.replace_expr(funcdef, second, ast.Name(id="z", ctx=ast.Load()))
    assert source.contains(funcdef, first) and not source.contains(funcdef, second)
    assert "a = self.p(x)" in source.unparse(funcdef)
    assert "b = z" in source.unparse(funcdef)


def test_replace_expr_does_not_revisit_the_replacement() -> None:
    funcdef = parse_def("def f(self, x):\n    return self.p(x)\n")
    call = find_call(funcdef, "p")
    wrapped = ast.Call(func=ast.Name(id="g", ctx=ast.Load()), args=[call], keywords=[])
    source.replace_expr(funcdef, call, wrapped)  # `new` contains `old`: no infinite loop
    assert source.unparse(funcdef).strip().endswith("return g(self.p(x))")


# -- dominating_block, block_chain, enclosing_loops --------------------------------------------

NESTED = """
def forward(self, x, flag, other):
    h = self.a(x)
    if flag:
        if other:
            q = self.q(h)
            k = self.k(h)
        else:
            v = self.v(h)
        w = self.w(h)
    else:
        u = self.u(h)
    for i in range(2):
        l = self.l(h)
    try:
        t = self.t(h)
    except ValueError:
        e = self.e(h)
    with ctx():
        c = self.c(h)
    return self.o(h)
"""


@pytest.mark.parametrize(
    ("names", "path", "indices"),
    [
        (["q", "k"], [1, "body", 0, "body"], [0, 1]),  # same inner block
        (["q", "v"], [1, "body"], [0, 0]),  # if/else of the inner if: its statement
        (["q", "w"], [1, "body"], [0, 1]),  # inner if statement, then w
        (["q", "u"], [], [1, 1]),  # both branches of the outer if
        (["a", "q"], [], [0, 1]),
        (["a", "o"], [], [0, 5]),
        (["q"], [1, "body", 0, "body"], [0]),
        (["l", "o"], [], [2, 5]),
        (["t", "e"], [], [3, 3]),  # try body and handler: the try statement
        (["c", "a"], [], [4, 0]),
    ],
)
def test_dominating_block(names: list[str], path: list, indices: list[int]) -> None:
    funcdef = parse_def(NESTED)
    calls = [find_call(funcdef, name) for name in names]
    block, found = source.dominating_block(funcdef, calls)
    expected: Any = funcdef.body
    for step in path:
        expected = expected[step] if isinstance(step, int) else getattr(expected, step)
    assert block is expected
    assert found == indices


def test_dominating_block_refuses_a_foreign_node() -> None:
    funcdef = parse_def(NESTED)
    stranger = ast.parse("self.q(h)", mode="eval").body
    with pytest.raises(RewriteRefused):
        source.dominating_block(funcdef, [find_call(funcdef, "q"), stranger])


def test_block_chain() -> None:
    funcdef = parse_def(NESTED)
    chain = source.block_chain(funcdef.body, find_call(funcdef, "k"))
    outer_if = funcdef.body[1]
    assert [index for _, index in chain] == [1, 0, 1]
    assert chain[0][0] is funcdef.body and chain[1][0] is outer_if.body
    assert source.block_chain(funcdef.body, ast.Name(id="nowhere")) == []


def test_enclosing_loops() -> None:
    funcdef = parse_def(
        """
        def forward(self, x):
            for i in range(2):
                a = self.a(x)
            while x:
                b = self.b(x)
            c = [self.c(x) for _ in range(2)]
            d = lambda: self.d(x)
            e = self.e(x)
            def inner():
                return self.f(x)
            g = {k: self.g(x) for k in "ab"}
            h = sum(self.h(x) for _ in range(2))
        """
    )
    kinds = {name: source.enclosing_loops(funcdef, find_call(funcdef, name)) for name in "abcdefgh"}
    assert kinds == {
        "a": ["For"],
        "b": ["While"],
        "c": ["ListComp"],
        "d": ["Lambda"],
        "e": [],
        "f": ["FunctionDef"],
        "g": ["DictComp"],
        "h": ["GeneratorExp"],
    }


# -- self_call_and_refs ------------------------------------------------------------------------


def test_self_call_and_refs_finds_the_call_and_guards() -> None:
    funcdef = parse_def(
        """
        def forward(self, x):
            if self.q is not None:
                y = self.q(x)
            return y if self.q else x
        """
    )
    call, refs = source.self_call_and_refs(funcdef, "q")
    assert call is find_call(funcdef, "q")
    assert len(refs) == 2 and all(ref is not call.func for ref in refs)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("y = self.q(x)\nz = self.q(x)", "called 2 times"),
        ("return x", "called 0 times"),
        ("for i in range(2):\n    y = self.q(x)", "inside a For"),
        ("y = [self.q(x) for _ in range(2)]", "inside a ListComp"),
        ("y = (self.q(x) for _ in range(2))", "inside a GeneratorExp"),
        ("y = lambda: self.q(x)", "inside a Lambda"),
        ("while x:\n    y = self.q(x)", "inside a While"),
        ("y = self.q(input=x)", "not called as"),
        ("y = self.q(x, bias)", "not called as"),
        ("y = self.q(*xs)", "not called as"),
        ("y = self.q()", "not called as"),
    ],
)
def test_self_call_and_refs_refuses(body: str, reason: str) -> None:
    funcdef = parse_def("def forward(self, x):\n" + textwrap.indent(body, "    ") + "\n")
    with pytest.raises(RewriteRefused, match=reason):
        source.self_call_and_refs(funcdef, "q")


@pytest.mark.parametrize(
    "body",
    [
        'if hasattr(self, "q"):\n    x = x * 2',
        'm = getattr(self, "q", None)',
        'm = self._modules["q"]',
    ],
)
def test_self_call_and_refs_refuses_references_by_name(body: str) -> None:
    # After fusion the child is gone: a reference by string would silently change meaning.
    funcdef = parse_def(
        "def forward(self, x):\n" + textwrap.indent(body, "    ") + "\n    return self.q(x)\n"
    )
    with pytest.raises(RewriteRefused, match="by name"):
        source.self_call_and_refs(funcdef, "q")


# -- fold_existence_guard ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guard", "folded"),
    [
        ("self.q is not None", "True"),
        ("None is not self.q", "True"),
        ("self.q is None", "False"),
        ("None is self.q", "False"),
        ("self.q", "True"),
        ("not self.q", "not True"),
    ],
)
def test_fold_existence_guard_in_if(guard: str, folded: str) -> None:
    funcdef = parse_def(
        f"def forward(self, x):\n    if {guard}:\n        x = x * 2\n    return x\n"
    )
    (ref,) = source.self_refs(funcdef, "q")
    source.fold_existence_guard(funcdef, ref, "q")
    assert f"if {folded}:" in source.unparse(funcdef)
    assert source.self_refs(funcdef, "q") == []


@pytest.mark.parametrize(
    ("text", "folded"),
    [
        ("y = x if self.q else None", "y = x if True else None"),
        ("while self.q:\n        break", "while True:"),
        ("assert self.q", "assert True"),
        ("ok = self.q is not None and x is not None", "ok = True and x is not None"),
        ("flag = not self.q", "flag = not True"),
    ],
)
def test_fold_existence_guard_other_positions(text: str, folded: str) -> None:
    funcdef = parse_def(f"def forward(self, x):\n    {text}\n    return x\n")
    (ref,) = source.self_refs(funcdef, "q")
    source.fold_existence_guard(funcdef, ref, "q")
    assert folded in source.unparse(funcdef)


@pytest.mark.parametrize(
    "text",
    [
        "if self.q == None:\n        pass",
        "if self.q != None:\n        pass",
        "if None == self.q:\n        pass",
        "y = self.q or x",
        "y = self.q and x",
        "w = self.q.weight",
        "y = helper(self.q)",
        "y = self.q if x else None",
        "if self.q is x:\n        pass",
        "if self.q is not None is not x:\n        pass",
    ],
)
def test_fold_existence_guard_refuses(text: str) -> None:
    funcdef = parse_def(f"def forward(self, x):\n    {text}\n    return x\n")
    (ref,) = source.self_refs(funcdef, "q")
    before = source.unparse(funcdef)
    with pytest.raises(RewriteRefused, match="not an existence guard"):
        source.fold_existence_guard(funcdef, ref, "q")
    assert source.unparse(funcdef) == before
