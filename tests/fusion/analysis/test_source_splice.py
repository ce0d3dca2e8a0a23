"""fusion.analysis.source: splice the merged call into a forward and compile it again (same
results, tracebacks at the original lines and columns, the original globals, defaults and
future flags), and read a forward's source for what the fusers ask of it."""

from __future__ import annotations

import ast
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

from fusion.analysis import source
from fusion.errors import RewriteRefused
from tests.fusion.analysis.source_forwards import Plain, find_call, parse_def, passthrough

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
