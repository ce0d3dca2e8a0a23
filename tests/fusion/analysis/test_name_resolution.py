"""`fusion.analysis.name_resolution`: `self.<name>` resolved exactly as Python resolves it (issue 24).

Python looks a module attribute up on the class first (a method there wins over a child of
the same name, which `nn.Module.__getattr__` would only find if normal lookup failed). The
analysis once read the child's forward where Python ran the method. Every resolution here is
checked against `getattr`, and every case the analysis must refuse runs the fused and the
unfused module on the same input.
"""

from __future__ import annotations

import ast
import copy
import functools
import textwrap

import pytest
import torch
from torch import nn

import fusion
from fusion.analysis.name_resolution import (
    Kind,
    resolve,
    resolve_chain,
    self_chain,
    self_is_bound_to_owner,
)
from fusion.fusers import registry
from tests.fusion.fusers.hazards import eager_attention_forward
from tests.fusion.fusers.helpers import outputs_match, reasons


class Probe(nn.Module):
    """One attribute of every kind `resolve` tells apart."""

    constant = 3

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("buffer", torch.zeros(2))
        self.register_parameter("no_parameter", None)
        self.register_module("no_child", None)
        self.setting = 1.5

    def method(self, x):
        return x

    @staticmethod
    def static(x):
        return x

    @classmethod
    def klass(cls, x):
        return x

    @property
    def computed(self):
        return self.linear

    @functools.cached_property
    def cached(self):
        return self.linear


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("linear", Kind.CHILD),
        ("buffer", Kind.BUFFER),
        ("no_parameter", Kind.PARAMETER),
        ("no_child", Kind.CHILD),
        ("setting", Kind.INSTANCE),
        ("training", Kind.INSTANCE),
        ("constant", Kind.CLASS_VALUE),
        ("method", Kind.METHOD),
        ("forward", Kind.METHOD),  # nn.Module's own placeholder
        ("static", Kind.STATIC),
        ("klass", Kind.UNKNOWN),
        ("computed", Kind.UNKNOWN),
        ("cached", Kind.UNKNOWN),
        ("absent", Kind.ABSENT),
    ],
)
def test_resolve_kinds(name: str, kind: Kind) -> None:
    assert resolve(Probe(), name).kind is kind


@pytest.mark.parametrize(
    "name",
    ["linear", "buffer", "no_parameter", "no_child", "setting", "constant", "method", "static"],
)
def test_resolution_agrees_with_python(name: str) -> None:
    probe = Probe()
    resolved = resolve(probe, name)
    actual = getattr(probe, name)
    if resolved.kind is Kind.METHOD:
        assert actual.__func__ is resolved.value and actual.__self__ is probe
    else:
        assert actual is resolved.value


def test_absent_and_none_raise_when_called() -> None:
    probe = Probe()
    for name in ("absent", "no_child", "no_parameter"):
        assert resolve(probe, name).raises_when_called
    for name in ("linear", "method"):
        assert not resolve(probe, name).raises_when_called
    with pytest.raises(AttributeError):
        probe.absent()


class Pure(nn.Module):
    def forward(self, t):
        return t * 1.0


class PureWithParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, t):
        return t * self.weight


class MethodBesideChild(nn.Module):
    """A child registered as `scale` beside a class method `scale` that writes its input:
    Python runs the method (the class wins over `_modules`)."""

    def __init__(self, child: type[nn.Module] = Pure, register: str = "setattr") -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.k_proj = nn.Linear(8, 8, bias=False)
        self.v_proj = nn.Linear(8, 8, bias=False)
        if register == "setattr":
            self.scale = child()  # nn.Module.__setattr__ files it under _modules
        else:
            self._modules["scale"] = child()

    def scale(self, t):
        t.mul_(1.57)
        return t

    def forward(self, x):
        q = self.q_proj(x)
        _scaled = self.scale(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        out, _ = eager_attention_forward(self, q, k, v)
        return out


def test_a_method_beside_a_child_of_the_same_name_is_ambiguous() -> None:
    module = MethodBesideChild()
    assert module.scale.__func__ is MethodBesideChild.scale  # what Python runs
    resolved = resolve(module, "scale")
    assert resolved.kind is Kind.UNKNOWN
    assert "ambiguous" in resolved.reason


def test_an_instance_attribute_beside_a_child_is_ambiguous() -> None:
    probe = Probe()
    object.__setattr__(probe, "linear", Pure())  # bypasses nn.Module.__setattr__
    assert "ambiguous" in resolve(probe, "linear").reason


def test_a_class_of_its_own_getattr_is_unknown() -> None:
    class Forwarding(nn.Module):
        def __getattr__(self, name):
            return super().__getattr__(name)

    module = Forwarding()
    module.linear = nn.Linear(2, 2)
    assert resolve(module, "linear").kind is Kind.UNKNOWN


@pytest.mark.parametrize("register", ["setattr", "modules"])
@pytest.mark.parametrize("child", [Pure, PureWithParameter], ids=["pure", "with-parameter"])
def test_a_method_beside_a_child_is_refused_with_a_reason(
    child: type[nn.Module], register: str
) -> None:
    """The proof read the child's (pure) forward where Python runs the writing method: the
    merge changed the output (by 0.57 x); with a parameter in the child, `fuse` raised
    AttributeError. Now: refused, saying why, and outputs unchanged."""
    registry.clear_cache()
    module = MethodBesideChild(child, register)
    fused = copy.deepcopy(module)
    report = fusion.fuse(fused)
    assert not report.applied, str(report)
    assert "self.scale is ambiguous" in reasons(report)
    assert outputs_match(module, fused, 2, 5, 8)


@pytest.mark.parametrize(
    ("chain", "kind"),
    [
        (("linear",), Kind.CHILD),
        (("linear", "weight"), Kind.PARAMETER),
        (("linear", "forward"), Kind.METHOD),
        (("setting", "real"), Kind.OF_OBJECT),  # not a module: not the analysis's to resolve
        (("computed", "weight"), Kind.UNKNOWN),
    ],
)
def test_resolve_chain(chain: tuple[str, ...], kind: Kind) -> None:
    assert resolve_chain(Probe(), chain).kind is kind


@pytest.mark.parametrize(
    ("text", "chain"),
    [
        ("self.a", ("a",)),
        ("self.a.b", ("a", "b")),
        ("self", None),
        ("other.a", None),
        ("self.a[0]", None),
        ("self.a().b", None),
    ],
)
def test_self_chain(text: str, chain: tuple[str, ...] | None) -> None:
    assert self_chain(ast.parse(text, mode="eval").body) == chain


@pytest.mark.parametrize(
    ("source", "bound"),
    [
        ("def f(self, x):\n    return self.a(x)", True),
        ("def f(self, x):\n    self.a = x\n    return self.a", True),  # a store, no rebinding
        ("def f(self, x):\n    self = self.other\n    return self.a(x)", False),
        ("def f(self, x):\n    for self in [x]:\n        pass", False),
        ("def f(self, x):\n    del self", False),
        ("def f(self, x):\n    (self := x)", False),
        ("def f(self, x):\n    import os as self", False),
        ("def f(self, x):\n    g = lambda self: self\n    return g(x)", False),
        ("def f(self, x):\n    def self():\n        pass", False),
        ("def f(self, x):\n    try:\n        pass\n    except E as self:\n        pass", False),
        ("def f(self, x):\n    match x:\n        case self:\n            pass", False),
        ("def f(x, self):\n    return self.a(x)", False),  # `self` is not the receiver
        ("def f(x):\n    return x", False),
    ],
)
def test_self_is_bound_to_owner(source: str, bound: bool) -> None:
    funcdef = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(funcdef, ast.FunctionDef)
    assert self_is_bound_to_owner(funcdef) is bound


class Scaler(nn.Module):
    def scale(self, t):
        return t.mul_(1.5)


class SelfReboundForward(nn.Module):
    """The forward rebinds `self` for one call: `self.scale` there is the Scaler's method
    (which writes `x`), not this module's `scale` child (an `nn.Linear`, which does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.k_proj = nn.Linear(8, 8, bias=False)
        self.v_proj = nn.Linear(8, 8, bias=False)
        self.scale = nn.Linear(8, 8, bias=False)
        self.other = Scaler()

    def forward(self, x):
        owner = self
        q = owner.q_proj(x)
        self = owner.other
        _scaled = self.scale(x)
        k = owner.k_proj(x)
        v = owner.v_proj(x)
        out, _ = eager_attention_forward(owner, q, k, v)
        return out


class SelfReboundBetweenCalls(SelfReboundForward):
    """`self` is rebound and bound back between the projections called on it."""

    def forward(self, x):
        q = self.q_proj(x)
        owner = self
        self = self.other
        _scaled = self.scale(x)
        self = owner
        k = self.k_proj(x)
        v = self.v_proj(x)
        out, _ = eager_attention_forward(self, q, k, v)
        return out


@pytest.mark.parametrize("cls", [SelfReboundForward, SelfReboundBetweenCalls])
def test_a_forward_that_rebinds_self_resolves_nothing_on_it(cls: type[nn.Module]) -> None:
    registry.clear_cache()
    module = cls()
    fused = copy.deepcopy(module)
    report = fusion.fuse(fused)
    assert outputs_match(module, fused, 2, 5, 8), str(report)
    assert not report.applied, str(report)


class _BesideAFusableNorm(nn.Module):
    """The shadowed module next to something that does fuse (an RMSNorm), so `fuse` walks
    the parameters of the whole model (`apply.parameter_owners`)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = MethodBesideChild(PureWithParameter, "modules")
        self.norm = nn.RMSNorm(8, eps=1e-6)

    def forward(self, x):
        return self.attention(self.norm(x))


def test_a_shadowed_child_with_a_parameter_does_not_break_fusing_the_rest() -> None:
    """`fusion.fuse` raised `AttributeError: scale is not an nn.Module` whenever anything
    else in the model fused: the tied-parameter walk found each parameter's holder by
    attribute lookup, where the class method `scale` wins over the child."""
    registry.clear_cache()
    model = _BesideAFusableNorm()
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert any(a.fuser == "rmsnorm" for a in report.applied), str(report)
    assert not any(a.qualname == "attention" for a in report.applied)
    assert outputs_match(model, fused, 2, 5, 8)
