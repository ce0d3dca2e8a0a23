"""fusion.analysis.source: recover, edit and recompile a forward's source."""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import traceback
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers.utils.deprecation import deprecate_kwarg

from fusion.analysis import source
from fusion.errors import RewriteRefused
from tests.fusion.hf_modules import MODULE_NAMES, build_module


def parse_def(text: str) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(text)).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


def find_call(funcdef: ast.FunctionDef, name: str, nth: int = 0) -> ast.Call:
    calls = [
        n
        for n in ast.walk(funcdef)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
    ]
    return calls[nth]


# -- recover_forward ---------------------------------------------------------------------------


def passthrough(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def opaque(fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:  # no functools.wraps: cannot unwrap
        return fn(*args, **kwargs)

    return wrapper


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        y: torch.Tensor = self.p(x)
        return y * scale


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


# -- splice_merged_call, compile_forward ------------------------------------------------------


class QKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8, dtype=torch.float64)
        self.k = nn.Linear(8, 4, dtype=torch.float64)
        self.v = nn.Linear(8, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor, flag: bool = True) -> torch.Tensor:
        shape = x.shape[:-1]
        q = self.q(x).view(*shape, 2, 4)
        if flag:
            k = self.k(x) * 2
        else:
            k = torch.zeros(*shape, 4, dtype=x.dtype)
        v = torch.relu(self.v(x))
        return (q.sum(-2) + k) * v


class Merged(nn.Linear):
    """q, k and v stacked: one GEMM, split by `output_sizes` at run time."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        sizes = [p.out_features for p in parts]
        super().__init__(parts[0].in_features, sum(sizes), dtype=torch.float64)
        with torch.no_grad():
            self.weight.copy_(torch.cat([p.weight for p in parts]))
            self.bias.copy_(torch.cat([p.bias for p in parts]))
        self.output_sizes = sizes


def fuse_qkv(module: QKV) -> tuple[Callable, list[str]]:
    funcdef, fn = source.recover_forward(type(module))
    calls = [source.self_call_and_refs(funcdef, name)[0] for name in ("q", "k", "v")]
    block, indices = source.dominating_block(funcdef, calls)
    temps = source.splice_merged_call(funcdef, calls, block, min(indices), "qkv")
    return source.compile_forward(funcdef, fn), temps


@pytest.mark.parametrize("flag", [True, False])
def test_spliced_forward_computes_the_same(flag: bool) -> None:
    torch.manual_seed(0)
    module = QKV()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    expected = module(x, flag)
    compiled, temps = fuse_qkv(module)
    assert temps == ["_fused_qkv_0", "_fused_qkv_1", "_fused_qkv_2"]
    module.qkv = Merged([module.q, module.k, module.v])
    module.forward = types.MethodType(compiled, module)
    assert torch.allclose(module(x, flag), expected, rtol=0, atol=1e-12)
    # Only this instance changed: another instance still runs the original forward.
    assert QKV.forward is not compiled and "qkv" not in QKV().__dict__.get("_modules", {})


def test_spliced_source_reads_the_input_once() -> None:
    funcdef, _ = source.recover_forward(QKV)
    calls = [source.self_call_and_refs(funcdef, name)[0] for name in ("q", "k", "v")]
    block, indices = source.dominating_block(funcdef, calls)
    source.splice_merged_call(funcdef, calls, block, min(indices), "qkv")
    text = source.unparse(funcdef)
    assert text.count("self.qkv(x)") == 1
    assert "_fused_qkv_0, _fused_qkv_1, _fused_qkv_2 = self.qkv(x).split(" in text
    assert "self.qkv.output_sizes, -1)" in text
    for name in ("self.q(", "self.k(", "self.v("):
        assert name not in text
    # The split sits right before the statement holding the first call.
    split = next(i for i, s in enumerate(funcdef.body) if "self.qkv" in ast.unparse(s))
    assert "self.q" not in ast.unparse(funcdef.body[split + 1]) and split == 1


@pytest.mark.parametrize(
    ("extra", "merged"),
    [
        ("_fused_qkv_1 = 0", "qkv"),  # a temporary would shadow a local
        ("y = _fused_qkv_0", "qkv"),  # ... or a global read
        ("y = self.qkv", "qkv"),  # the merged name is already an attribute in use
    ],
)
def test_splice_refuses_collisions(extra: str, merged: str) -> None:
    funcdef = parse_def(
        f"""
        def forward(self, x):
            {extra}
            q = self.q(x)
            k = self.k(x)
            return q + k
        """
    )
    calls = [find_call(funcdef, "q"), find_call(funcdef, "k")]
    before = source.unparse(funcdef)
    with pytest.raises(RewriteRefused, match="collide"):
        source.splice_merged_call(funcdef, calls, funcdef.body, 1, merged)
    assert source.unparse(funcdef) == before


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(4, 4)

    @passthrough
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.p(x)
        if y.shape[-1] == 4:
            raise ValueError("raised from the original line")  # RAISE-LINE
        return y


def raise_line() -> int:
    lines, start = inspect.getsourcelines(Raises.forward)
    return start + next(i for i, line in enumerate(lines) if "RAISE-LINE" in line)


def test_compiled_forward_tracebacks_point_at_the_original_source() -> None:
    funcdef, fn = source.recover_forward(Raises)
    compiled = source.compile_forward(funcdef, fn)
    assert compiled.__qualname__ == fn.__qualname__
    module = Raises()
    with pytest.raises(ValueError, match="original line") as info:
        compiled(module, torch.ones(2, 4))
    frame = info.traceback[-1]
    assert frame.path == __file__ or str(frame.path) == __file__
    assert frame.lineno + 1 == raise_line()  # pytest's lineno is 0-based
    # The formatted traceback shows the original source text of that line.
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{__file__}", line {raise_line()}, in forward' in text
    assert 'raise ValueError("raised from the original line")' in text


def test_compile_forward_twice_keeps_line_numbers() -> None:
    funcdef, fn = source.recover_forward(Raises)
    before = ast.dump(funcdef, include_attributes=True)
    first = source.compile_forward(funcdef, fn)
    second = source.compile_forward(funcdef, fn)
    assert ast.dump(funcdef, include_attributes=True) == before, "funcdef must not change"
    assert first.__code__.co_firstlineno == second.__code__.co_firstlineno
    # Decorators are dropped: the compiled code starts at the `def` line, the decorator's next.
    assert first.__code__.co_firstlineno == fn.__code__.co_firstlineno + 1
    with pytest.raises(ValueError) as info:
        second(Raises(), torch.ones(2, 4))
    assert info.traceback[-1].lineno + 1 == raise_line()


def test_spliced_statement_reports_the_line_it_replaced() -> None:
    # The inserted split carries the location of the statement it precedes.
    module = QKV()
    compiled, _ = fuse_qkv(module)
    module.qkv = nn.Identity()  # no `.output_sizes`: the split statement raises
    module.forward = types.MethodType(compiled, module)
    with pytest.raises(AttributeError) as info:
        module(torch.ones(2, 8, dtype=torch.float64))
    lines, start = inspect.getsourcelines(QKV.forward)
    q_line = start + next(i for i, line in enumerate(lines) if "self.q(x)" in line)
    (entry,) = [e for e in info.traceback if e.name == "forward" and str(e.path) == __file__]
    assert entry.lineno + 1 == q_line


class MissingAttribute(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        z = y + 1 + y.no_such_attribute  # CARET-LINE
        return z


def test_traceback_carets_point_at_the_original_columns() -> None:
    funcdef, fn = source.recover_forward(MissingAttribute)
    compiled = source.compile_forward(funcdef, fn)
    with pytest.raises(AttributeError) as info:
        compiled(MissingAttribute(), torch.ones(2))
    lines = "".join(traceback.format_exception(info.value)).splitlines()
    at = next(i for i, line in enumerate(lines) if "CARET-LINE" in line)
    code, carets = lines[at], lines[at + 1]
    start = carets.index("^")
    assert code[start:].startswith("y.no_such_attribute")
    assert carets.strip() == "^" * len("y.no_such_attribute")


def load_module(tmp_path: Any, name: str, text: str) -> types.ModuleType:
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NESTED_ANNOTATIONS = """
    from torch import nn

    class M(nn.Module):
        def forward(self, x):
            def inner(a: int) -> int:
                return a
            return inner
"""


@pytest.mark.parametrize("future", [False, True])
def test_compile_forward_uses_the_original_future_flags(tmp_path: Any, future: bool) -> None:
    header = "from __future__ import annotations\n" if future else ""
    mod = load_module(tmp_path, f"nested_{future}", header + textwrap.dedent(NESTED_ANNOTATIONS))
    funcdef, fn = source.recover_forward(mod.M)
    compiled = source.compile_forward(funcdef, fn)
    original = fn(mod.M(), 0).__annotations__
    assert original == ({"a": "int", "return": "int"} if future else {"a": int, "return": int})
    assert compiled(mod.M(), 0).__annotations__ == original


class ClassLevelDefault(nn.Module):
    SCALE = 3.0

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, scale: float = SCALE, *, bias: float = SCALE
    ) -> torch.Tensor:
        return self.p(x) * scale + bias


def test_compile_forward_keeps_the_original_defaults() -> None:
    # Defaults evaluated in the class body (a class attribute) cannot be re-evaluated in the
    # module's globals; the compiled function reuses the original default objects.
    funcdef, fn = source.recover_forward(ClassLevelDefault)
    compiled = source.compile_forward(funcdef, fn)
    assert compiled.__defaults__ == fn.__defaults__
    assert compiled.__kwdefaults__ == fn.__kwdefaults__
    module = ClassLevelDefault()
    x = torch.ones(2, 4)
    assert torch.equal(compiled(module, x), module(x))


def test_compile_forward_runs_in_the_original_globals() -> None:
    funcdef, fn = source.recover_forward(Plain)
    compiled = source.compile_forward(funcdef, fn)
    assert compiled.__globals__ is fn.__globals__
    assert compiled.__module__ == fn.__module__


def test_unparse_ends_with_newline() -> None:
    funcdef, _ = source.recover_forward(Plain)
    text = source.unparse(funcdef)
    assert text.endswith("\n") and text.startswith("def forward(self, x, scale=1.0):")
    assert sys.modules[__name__] is not None


def test_returns_tuple_and_reads_training_read_the_forward_source() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor):
            out = (x, x)
            return out

    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                return x * 2
            return x

    assert source.returns_tuple(Pair) and not source.reads_training(Pair)
    assert not source.returns_tuple(Branchy) and source.reads_training(Branchy)
    unreadable = type("Unreadable", (nn.Module,), {"forward": eval("lambda self, x: x")})
    assert source.returns_tuple(unreadable) and source.reads_training(unreadable)  # fail closed


def test_method_source_reads_a_method_or_refuses() -> None:
    class Norm(nn.Module):
        @torch.no_grad()
        def _norm(self, x: torch.Tensor) -> torch.Tensor:
            return x

    funcdef = source.method_source(Norm, "_norm")
    assert funcdef.name == "_norm" and not funcdef.decorator_list
    unreadable = type("Unreadable", (nn.Module,), {"forward": eval("lambda self, x: x")})
    with pytest.raises(RewriteRefused):
        source.method_source(unreadable)


def test_a_forward_whose_first_parameter_is_not_self_is_refused_with_that_reason(load) -> None:
    """Issue 28: such a forward used to be refused with "self.gate is called 0 times"."""
    import fusion

    mods = load(
        "import torch.nn as nn\n"
        "class MLP(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.gate, self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)\n"
        "        self.act = nn.SiLU()\n"
        "    def forward(this, x):\n"
        "        return this.down(this.act(this.gate(x)) * this.up(x))\n"
    )
    reasons = {s.fuser: s.reason for s in fusion.plan(mods.MLP()).skipped}
    assert "glu" in reasons, reasons
    assert reasons["glu"].startswith("the forward's first parameter is 'this', not 'self'")
