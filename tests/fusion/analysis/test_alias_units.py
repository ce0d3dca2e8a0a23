"""fusion.analysis.alias, its vocabulary (`alias_terms`) and per-call verdicts (`call_effects`)
unit by unit: which child calls count as writes, the helpers asked directly, real Transformers
modules whose regions must stay accepted, and the soundness property over the generated
grammar of forwards (`tests/fusion/forward_grammar.py`).
"""

from __future__ import annotations

import ast
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

from fusion.analysis import alias, alias_terms, call_effects
from fusion.analysis.alias import check_input_stable
from fusion.analysis.alias_terms import EVERYTHING
from fusion.errors import RewriteRefused
from tests.fusion.analysis.alias_programs import (
    expr,
    funcdef_of,
    judged_stable,
    program,
)
from tests.fusion.forward_programs import (
    NAMESPACE,
    Program,
    TwoProjections,
    programs,
    run,
    unchanged,
)
from tests.fusion.hf_modules import build_module

# -- children: which module calls count as writes -----------------------------------------


class Doubler(nn.Module):
    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return v.mul_(2.0)


class MyLinear(nn.Linear):
    pass


def module_with(**children: nn.Module) -> nn.Module:
    module = TwoProjections()
    for name, child in children.items():
        setattr(module, name, child)
    return module


@pytest.mark.parametrize(
    ("child", "stable"),
    [
        (nn.Linear(4, 4, dtype=torch.float64), True),
        (nn.Dropout(0.0), True),
        (nn.Identity(), True),
        (nn.LayerNorm(4, dtype=torch.float64), True),
        (nn.Dropout(0.0, inplace=True), False),
        (nn.ReLU(inplace=True), False),
        (Doubler(), False),
        (MyLinear(4, 4, dtype=torch.float64), False),
        (nn.Embedding(4, 4, dtype=torch.float64), True),
        # renormalises the rows it looks up, in its own weight, in place
        (nn.Embedding(4, 4, max_norm=1.0, dtype=torch.float64), False),
        # updates its running statistics in place (training mode)
        (nn.BatchNorm1d(4, dtype=torch.float64), False),
    ],
    ids=[
        "linear",
        "dropout",
        "identity",
        "layernorm",
        "dropout-inplace",
        "relu-inplace",
        "custom",
        "linear-subclass",
        "embedding",
        "embedding-max-norm",
        "batchnorm-training",
    ],
)
def test_child_calls(child: nn.Module, stable: bool) -> None:
    assert judged_stable(program(mid="y = self.c(x)"), module_with(c=child)) is stable


def test_child_with_an_instance_forward_is_a_write() -> None:
    """`linear.forward = f` makes calling the linear run `f` (nn.Module's call path reads
    `self.forward`), whatever its class's forward does."""
    linear = nn.Linear(4, 4, dtype=torch.float64)
    linear.forward = lambda v: v.mul_(2.0)  # type: ignore[method-assign]
    x = torch.ones(4, 4, dtype=torch.float64)
    linear(x)
    assert torch.equal(x, torch.full((4, 4), 2.0, dtype=torch.float64))
    assert not judged_stable(program(mid="y = self.c(x)"), module_with(c=linear))
    # ...nor is its output new storage: it may be the input itself
    assert not judged_stable(program("h = self.p3(x)", "h.add_(1.0)"), module_with(p3=linear))


class WithScale(TwoProjections):
    """A class method `c` beside a child registered as `c`: Python runs the method."""

    def c(self, v):
        return v.mul_(2.0)


def test_a_method_beside_a_child_of_the_same_name_is_refused() -> None:
    module = WithScale()
    module.c = nn.Linear(4, 4, dtype=torch.float64)  # filed under _modules, never looked up
    assert module.c.__func__ is WithScale.c
    funcdef = program(mid="y = self.c(x)").funcdef()
    expr, region = Program.region(funcdef)
    with pytest.raises(RewriteRefused, match=r"self\.c is ambiguous"):
        check_input_stable(funcdef, module, expr, region)


def test_a_forward_that_rebinds_self_knows_nothing_of_self() -> None:
    module = module_with(c=nn.Linear(4, 4, dtype=torch.float64))
    assert judged_stable(program(mid="y = self.c(x)"), module)
    assert not judged_stable(program(pre="self = self.p3", mid="y = self.c(x)"), module)


def test_child_with_hook_is_a_write() -> None:
    linear = nn.Linear(4, 4, dtype=torch.float64)
    linear.register_forward_pre_hook(lambda mod, args: args[0].add_(1.0))
    assert not judged_stable(program(mid="y = self.c(x)"), module_with(c=linear))


def test_linear_with_hook_is_not_fresh() -> None:
    # A forward hook may return the input itself: the "fresh" output then aliases `x`.
    linear = nn.Linear(4, 4, dtype=torch.float64)
    linear.register_forward_hook(lambda mod, args, out: args[0])
    prog = program("h = self.p3(x)", "h.add_(1.0)")
    module = module_with(p3=linear)
    assert not judged_stable(prog, module)
    assert judged_stable(prog, TwoProjections())


def test_missing_child_call_writes_nothing() -> None:
    # `self.absent(x)` raises before it can write: the branch of another configuration.
    assert judged_stable(program(mid="if False:\n    y = self.absent(x)"))


def test_without_a_module_every_child_call_is_a_write() -> None:
    funcdef = program(mid="y = self.p3(x)").funcdef()
    expr, region = Program.region(funcdef)
    with pytest.raises(RewriteRefused):
        check_input_stable(funcdef, None, expr, region)


# -- the helpers directly ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fresh"),
    [
        ("1.5", True),
        ("None", True),
        ("self.p3(x)", True),
        ("self.p3(x).view(-1).transpose(0, 1)", True),
        ("(self.p3(x), 2)", True),
        ("self.p3(x) if c else 1", True),
        ("x if True else self.p3(x)", False),
        ("x if False else self.p3(x)", True),
        ("self.p3(x).view(shape)", False),  # `shape` could be anything: look inside
        ("self.p3(x).set_(x)", False),
        ("self.p3(x).new(x)", False),
        ("self.absent(x)", True),
        ("x", False),
        ("x.clone()", False),
        ("torch.zeros(2)", False),
        ("[x]", False),
    ],
)
def test_returns_fresh(text: str, fresh: bool) -> None:
    assert alias_terms.returns_fresh(expr(text), TwoProjections()) is fresh


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("x", {"x"}),
        ("x.shape", set()),
        ("x.shape[0]", set()),
        ("x.size(n)", {"n"}),
        ("x.dtype", set()),
        ("x.view(-1)", {"x"}),
        ("x + y", {"x", "y"}),
        ("self.p3(x)", set()),
        ("self.p3(x).view(shape)", {"shape"}),
        ("self.p3(x).set_(y)", {"y"}),
        ("[x, 1]", {"x"}),
        ("{'a': x}", {"x"}),
        ("lambda: x", {"x"}),
        ("locals()", {"locals", EVERYTHING}),
        ("sys._getframe()", {"sys", EVERYTHING}),
    ],
)
def test_alias_reads(text: str, names: set[str]) -> None:
    assert alias_terms.alias_reads(expr(text), TwoProjections()) == names


def test_aliasing_names_reaches_a_fixed_point() -> None:
    # `c` aliases `x` only through `b`, bound after `c` in source order.
    funcdef = funcdef_of(
        """
        c = [b]
        a = x.view(-1)
        b = a[1:]
        s = x.shape
        f = self.p3(x)
        """
    )
    assert alias.aliasing_names(funcdef, {"x"}, TwoProjections()) == {"x", "a", "b", "c"}


def test_aliasing_names_is_flow_insensitive() -> None:
    # `h` aliases `x` only after the write; the analysis still counts it (safe direction).
    funcdef = funcdef_of("h = torch.zeros(2)\nh.add_(1.0)\nh = x")
    assert "h" in alias.aliasing_names(funcdef, {"x"}, None)


@pytest.mark.parametrize(
    ("body", "written", "not_written"),
    [
        ("y = 1", {"y"}, {"x"}),
        ("del y", {"y"}, {"x"}),
        ("y[0] = x", {"y"}, {"x"}),
        ("y.a.b = x", {"y"}, {"x"}),
        ("y.add_(x)", {"y", "x"}, set()),  # not known pure: every argument counts
        ("torch.relu_(y)", {"y"}, {"x"}),
        ("z = F.relu(y, inplace=True)", {"y", "z"}, {"x"}),
        ("z = F.relu(y, inplace=False)", {"z"}, {"y"}),
        ("z = torch.add(y, 1, out=w)", {"w", "z"}, {"x"}),
        ("y.sum()", {"y"}, {"x"}),
        ("z = y.sum()", {"z"}, {"y"}),
        ("z = y.shape", {"z"}, {"y"}),
        ("for a in y:\n    pass", {"a"}, {"y"}),
        ("if c:\n    y.add(1)", {"y"}, {"c"}),
        ("exec('y = 1')", {EVERYTHING}, set()),
        ("f = locals", {EVERYTHING}, set()),
    ],
)
def test_written_names(body: str, written: set[str], not_written: set[str]) -> None:
    found = alias.written_names(funcdef_of(body).body, TwoProjections())
    assert written <= found
    assert not (not_written & found)


@pytest.mark.parametrize(
    ("text", "writes"),
    [
        ("x.add_(1)", True),
        ("torch.relu_(x)", True),
        ("x.__iadd__(1)", True),
        ("torch.ops.aten.add_.Tensor(x, y)", True),
        ("torch.add(x, 1, out=y)", True),
        ("F.relu(x, inplace=True)", True),
        ("F.relu(x, inplace=flag)", True),
        ("F.relu(x, inplace=False)", False),
        ("F.relu(x, True)", True),
        ("F.relu(x, False)", False),
        ("F.dropout(x, 0.1, True, True)", True),
        ("F.dropout(x, 0.1, True)", False),
        ("F.relu(x, *rest)", True),
        ("F.relu(x, **options)", True),
        ("torch.relu(x)", False),
        ("x.__add__(1)", False),
    ],
)
def test_writes_through_args(text: str, writes: bool) -> None:
    call = expr(text)
    assert isinstance(call, ast.Call)
    assert call_effects.writes_through_args(call) is writes


# -- real Transformers modules: what the fusers need must stay accepted ---------------------


@pytest.mark.parametrize(
    ("name", "projections"),
    [
        ("LlamaAttention", ("q_proj", "k_proj", "v_proj")),
        ("Qwen3Attention", ("q_proj", "k_proj", "v_proj")),
        ("Gemma3Attention", ("q_proj", "k_proj", "v_proj")),
        ("LlamaMLP", ("gate_proj", "up_proj")),
        ("DeepseekV3Attention[q_lora]", ("q_a_proj", "kv_a_proj_with_mqa")),
        ("DeepseekV3Attention[no_q_lora]", ("q_proj", "kv_a_proj_with_mqa")),
    ],
)
def test_real_projection_regions_are_stable(name: str, projections: tuple[str, ...]) -> None:
    from fusion.analysis import source

    module = build_module(name)
    funcdef, _ = source.recover_forward(type(module))
    calls = [source.self_call_and_refs(funcdef, p)[0] for p in projections]
    block, indices = source.dominating_block(funcdef, calls)
    region = block[min(indices) : max(indices) + 1]
    check_input_stable(funcdef, module, calls[0].args[0], region)


def test_real_region_with_an_injected_write_is_refused() -> None:
    from fusion.analysis import source

    module = build_module("LlamaAttention")
    funcdef, _ = source.recover_forward(type(module))
    calls = [source.self_call_and_refs(funcdef, p)[0] for p in ("q_proj", "k_proj", "v_proj")]
    block, indices = source.dominating_block(funcdef, calls)
    block.insert(max(indices), ast.parse("hidden_states.mul_(2)").body[0])
    region = block[min(indices) : max(indices) + 2]
    with pytest.raises(RewriteRefused, match="hidden_states"):
        check_input_stable(funcdef, module, calls[0].args[0], region)


# -- the soundness property ------------------------------------------------------------------

ANALYSED = TwoProjections()


def verdict(prog: Program) -> bool:
    return judged_stable(prog, ANALYSED)


@given(programs())
def test_soundness(prog: Program) -> None:
    """Whenever the analysis says the input is stable between `self.p1(x)` and `self.p2(x)`,
    running the forward shows both calls saw the same input values."""
    if not verdict(prog):
        return
    seen = run(prog)
    assert seen is not None, "a generated program raised before its second projection"
    before, after = seen
    assert unchanged(before, after), "judged stable, but the input changed between the calls"


def test_grammar_is_not_vacuous() -> None:
    """The property has teeth only if the grammar produces both kinds of programs: many the
    analysis accepts (so the assertion is exercised), many it refuses, and many that really
    change the input (so a missed write would be caught)."""
    tally: Counter[str] = Counter()

    @settings(
        max_examples=400,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(programs())
    def collect(prog: Program) -> None:
        seen = run(prog)
        tally["total"] += 1
        tally["stable" if verdict(prog) else "refused"] += 1
        if seen is None:
            tally["raised"] += 1
        elif not unchanged(*seen):
            tally["changed"] += 1

    collect()
    total = tally["total"]
    assert tally["stable"] >= 0.2 * total, tally
    assert tally["refused"] >= 0.2 * total, tally
    assert tally["changed"] >= 0.1 * total, tally
    assert tally["raised"] <= 0.02 * total, tally


def test_namespace_matches_the_grammar() -> None:
    # Generated programs reach for these globals; a rename would silently break them all.
    assert set(NAMESPACE) == {"torch", "F", "nn", "operator", "contextlib"}


def test_torch_stack_is_not_inspect_stack() -> None:
    # `stack` is a frame attribute (`inspect.stack()`), but not on an unshadowed `torch`.
    assert judged_stable(program(mid="y = torch.stack([x, x])"))
    shadowing = program(pre="torch = __import__('inspect')", mid="y = torch.stack()")
    assert not judged_stable(shadowing)
