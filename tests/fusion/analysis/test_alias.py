"""fusion.analysis.alias: may-alias and may-write analysis.

Every hazard form is tested in both directions: a case the analysis must refuse also runs
the program and shows the input really changes (so the test proves a real hazard, not just
the current verdict), and a case it must accept shows the input really stays the same.
The Hypothesis property at the end checks soundness over a generated grammar of forwards.
"""

from __future__ import annotations

import ast
import ctypes
import warnings

import numpy
import pytest
import torch

from fusion.analysis import alias, call_effects
from fusion.analysis.alias import check_input_stable
from fusion.errors import RewriteRefused
from tests.fusion.analysis.alias_programs import (
    actually_changes,
    expr,
    funcdef_of,
    judged_stable,
    program,
)
from tests.fusion.forward_programs import NAMESPACE, Program, Recorder, TwoProjections, unchanged
from tests.write_spellings import Spelling, spellings

# Each case: (id, prelude, region). All must be refused, and each one really changes `x`
# between the two calls when run (float64, random input).
WRITES = [
    # rebinding and del
    ("rebind", "", "x = x + 1.0"),
    ("rebind-tuple-target", "", "x, y = x * 2.0, 1"),
    ("rebind-for-target", "", "for x in (x * 2.0,):\n    pass"),
    (
        "rebind-with-target",
        "import contextlib",
        "with contextlib.nullcontext(x * 2) as x:\n    pass",
    ),
    ("rebind-walrus", "", "y = (x := x * 2.0)"),
    ("del-and-rebind", "", "del x\nx = torch.zeros(4, 4, dtype=torch.float64)"),
    ("rebind-match-capture", "y = x * 2.0", "match y:\n    case x:\n        pass"),
    # item and attribute assignment
    ("setitem", "", "x[0] = 5.0"),
    ("setitem-ellipsis", "", "x[...] = 1.0"),
    ("setitem-augmented", "", "x[0] += 1.0"),
    ("setitem-through-view", "h = x.view(-1)", "h[0] = 5.0"),
    ("setitem-through-method-view", "", "x.view(-1)[0] = 7.0"),
    ("setitem-through-function-view", "", "torch.flatten(x)[0] = 7.0"),
    ("setitem-through-ternary", "", "(x if True else None)[...] = 6.0"),
    ("setattr-data", "", "x.data = torch.zeros(4, 4, dtype=torch.float64)"),
    # in-place methods and operators
    ("method", "", "x.add_(1.0)"),
    ("method-on-slice", "", "x[0].mul_(2.0)"),
    ("method-on-transpose", "", "x.t().neg_()"),
    ("method-result-kept", "", "y = x.sub_(1.0)"),
    ("method-nested-in-if", "", "if True:\n    x.fill_(3.0)"),
    ("augassign", "", "x += 1.0"),
    ("augassign-alias", "h = x", "h *= 2.0"),
    ("copy", "", "x.copy_(x * 2.0)"),
    ("set-storage", "", "x.set_(torch.ones(4, 4, dtype=torch.float64))"),
    # out=
    ("out", "", "torch.add(x, 1.0, out=x)"),
    ("out-of-fresh", "", "torch.add(torch.ones_like(x), 1.0, out=x)"),
    ("out-through-view", "h = x.view(-1)", "torch.neg(h, out=h)"),
    ("out-result-kept", "", "y = torch.mul(x, 2.0, out=x)"),
    # inplace=
    ("inplace-kw", "", "y = torch.nn.functional.hardtanh(x, -0.1, 0.1, inplace=True)"),
    ("inplace-kw-statement", "", "F.relu(x, inplace=True)"),
    ("inplace-positional", "", "y = F.hardtanh(x, -0.1, 0.1, True)"),
    ("inplace-positional-nested", "", "if True:\n    F.threshold(x, 0.0, 5.0, True)"),
    ("inplace-positional-nn-functional", "", "y = nn.functional.leaky_relu(x, 0.2, True)"),
    ("inplace-variable", "flag = True", "y = F.hardtanh(x, -0.1, 0.1, inplace=flag)"),
    ("inplace-splat-kwargs", "opts = {'inplace': True}", "y = F.hardtanh(x, -0.1, 0.1, **opts)"),
    ("inplace-splat-args", "opts = (-0.1, 0.1, True)", "y = F.hardtanh(x, *opts)"),
    # trailing-underscore functions
    ("underscore-fn", "", "torch.relu_(x)"),
    ("underscore-fn-kept", "", "y = torch.sigmoid_(x)"),
    ("underscore-fn-clamp", "", "y = torch.clamp_(x, min=0.5)"),
    ("underscore-init", "", "y = nn.init.zeros_(x)"),
    ("underscore-unbound-method", "", "y = torch.Tensor.add_(x, 1.0)"),
    ("underscore-op-overload", "", "y = torch.ops.aten.add_.Scalar(x, 1.0)"),
    # dunder and operator spellings
    ("operator-iadd", "", "y = operator.iadd(x, 1.0)"),
    ("operator-setitem", "", "y = operator.setitem(x, 0, 1.0)"),
    ("operator-nested", "", "for _ in range(1):\n    operator.imul(x, 2.0)"),
    ("dunder-iadd", "", "y = x.__iadd__(1.0)"),
    ("dunder-setitem", "", "y = x.__setitem__(0, 1.0)"),
    ("dunder-unbound", "", "y = torch.Tensor.__imul__(x, 2.0)"),
    # views
    ("view", "h = x.view(-1)", "h.add_(1.0)"),
    ("slice", "h = x[1:]", "h.zero_()"),
    ("select", "h = x[0]", "h.fill_(2.0)"),
    ("transpose", "h = x.transpose(0, 1)", "h.neg_()"),
    ("detach", "h = x.detach()", "h.add_(1.0)"),
    ("data", "h = x.data", "h.add_(1.0)"),
    ("function-view", "h = torch.flatten(x)", "h.add_(1.0)"),
    ("chunk-unpack", "a, b = x.chunk(2)", "b.zero_()"),
    ("split-unpack", "a, b = torch.split(x, 2)", "a.mul_(2.0)"),
    ("view-of-view", "h = x.view(-1)\ng = h[3:]", "g.add_(1.0)"),
    ("same-tensor-to", "h = x.to(torch.float64)", "h.add_(1.0)"),
    ("ternary", "h = x if len(x) else None", "h.add_(1.0)"),
    ("view-created-in-region", "", "h = x.view(-1)\nh.add_(1.0)"),
    # a fresh receiver whose method returns its *argument's* storage
    ("fresh-set-storage", "h = self.p3(x).set_(x)", "h.add_(1.0)"),
    ("fresh-new", "h = self.p3(x).new(x)", "h.add_(1.0)"),
    # walrus
    ("walrus-inline", "", "(h := x).add_(1.0)"),
    ("walrus-binding", "y = (h := x.view(-1))", "h.add_(1.0)"),
    # loop and comprehension targets
    ("for-target-body", "", "for t in (x,):\n    t.add_(1.0)"),
    ("for-target-after", "for t in [x]:\n    pass", "t.mul_(2.0)"),
    ("comprehension", "", "ys = [t.add_(1.0) for t in (x,)]"),
    ("comprehension-container", "ys = [t for t in (x,)]", "ys[0].neg_()"),
    # containers
    ("list", "c = [x]", "c[0].add_(1.0)"),
    ("tuple", "c = (x, 1)", "c[0].neg_()"),
    ("dict", "d = {'a': x}", "d['a'].mul_(2.0)"),
    ("list-append", "c = []\nc.append(x)", "c[0].add_(1.0)"),
    ("list-insert", "c = [None]\nc.insert(0, x)", "c[0].add_(1.0)"),
    ("list-store", "c = [None]\nc[0] = x", "c[0].add_(1.0)"),
    ("dict-update", "d = {}\nd.update(a=x)", "d['a'].add_(1.0)"),
    ("attribute-store", "self.saved = x", "self.saved.add_(1.0)"),
    ("container-alias", "c = [x]\nk = c", "k[0].add_(1.0)"),
    # bound methods and callables
    ("bound-method", "f = x.add_", "f(1.0)"),
    ("bound-method-getattr", "f = getattr(x, 'add_')", "f(1.0)"),
    ("getattr-call", "", "getattr(x, 'mul_')(2.0)"),
    ("lambda", "f = lambda: x.add_(1.0)", "f()"),
    ("lambda-argument", "f = lambda v: v.mul_(2.0)", "y = f(x)"),
    ("nested-def", "def f():\n    x.neg_()", "f()"),
    ("lambda-inline", "", "(lambda: x.add_(1.0))()"),
    ("shadowed-builtin", "min = lambda v: v.add_(1.0)", "y = min(x)"),
    ("builtin-key-callback", "", "m = max([x], key=lambda t: t.add_(1.0).sum())"),
    (
        "shadowed-namespace",
        "class F:\n    relu = staticmethod(lambda v: v.add_(1.0))",
        "y = F.relu(x)",
    ),
    # reflection
    ("exec", "", 'exec("x.add_(1.0)")'),
    ("eval", "", 'eval("x").add_(1.0)'),
    ("locals", "", 'locals()["x"].add_(1.0)'),
    ("vars", "", 'vars()["x"].add_(1.0)'),
    ("locals-snapshot", "d = locals()", 'd["x"].add_(1.0)'),
    ("locals-alias", "L = locals", 'L()["x"].add_(1.0)'),
    ("frame-locals", "import sys", 'sys._getframe().f_locals["x"].add_(1.0)'),
    # the input name rebound to another name's object: writes through that name count
    ("input-rebound-to-local", "v = torch.zeros(4, 4, dtype=torch.float64)\nx = v", "v.add_(1.0)"),
    (
        "input-rebound-via-closure",
        "v = torch.zeros(4, 4, dtype=torch.float64)\ndef f():\n    return v\nx = f()",
        "v.add_(1.0)",
    ),
    (
        "input-rebound-via-eval",
        "v = torch.zeros(4, 4, dtype=torch.float64)\nx = eval('v')",
        "v.add_(1.0)",
    ),
    (
        "input-rebound-in-loop",
        "v = torch.zeros(4, 4, dtype=torch.float64)\nfor x in (v,):\n    pass",
        "v.add_(1.0)",
    ),
    # match captures
    ("match-capture", "", "match x:\n    case h:\n        h.add_(1.0)"),
    ("match-capture-after", "match x:\n    case h:\n        pass", "h.add_(1.0)"),
    ("match-sequence", "", "match (x, 1):\n    case (h, _):\n        h.add_(1.0)"),
    # no in-place spelling at all (issue 24): functions that write what they are given
    ("swap-tensors", "", "y = torch.utils.swap_tensors(x, x * 2.0)"),
    (
        "vector-to-parameters",
        "",
        "y = nn.utils.vector_to_parameters(torch.zeros(16, dtype=torch.float64), [x])",
    ),
    ("init-constant", "", "y = nn.init.constant(x, 0.5)"),
    ("init-normal", "", "y = nn.init.normal(x)"),
    ("init-uniform", "", "y = nn.init.uniform(x)"),
    ("init-xavier-uniform", "", "y = nn.init.xavier_uniform(x)"),
    ("init-kaiming-normal", "", "y = nn.init.kaiming_normal(x)"),
    ("init-eye-full-path", "", "y = torch.nn.init.eye(x)"),
    ("embedding-max-norm", "", "y = F.embedding(torch.tensor([0, 1]), x, max_norm=0.1)"),
    ("embedding-max-norm-positional", "", "y = F.embedding(torch.tensor([0, 1]), x, None, 0.1)"),
    ("embedding-max-norm-variable", "m = 0.1", "y = F.embedding(torch.tensor([0]), x, max_norm=m)"),
    ("embedding-bag-max-norm", "", "y = F.embedding_bag(torch.tensor([[0, 1]]), x, max_norm=0.1)"),
    (
        "batch-norm-training",
        "",
        "y = F.batch_norm(torch.ones(3, 4, dtype=torch.float64), x[0], x[1], training=True)",
    ),
    (
        "batch-norm-training-positional",
        "",
        "y = F.batch_norm(torch.ones(3, 4, dtype=torch.float64), x[0], x[1], None, None, True)",
    ),
    (
        "torch-batch-norm",
        "",
        "y = torch.batch_norm(torch.ones(3, 4, dtype=torch.float64), None, None, x[0], x[1],"
        " True, 0.1, 1e-5, False)",
    ),
    (
        "native-batch-norm",
        "",
        "y = torch.native_batch_norm(torch.ones(3, 4, dtype=torch.float64), None, None, x[0],"
        " x[1], True, 0.1, 1e-5)",
    ),
    (
        "instance-norm-default-stats",
        "",
        "y = F.instance_norm(torch.randn(3, 4, 5, dtype=torch.float64), x[0], x[1])",
    ),
    (
        "checkpoint-callback",
        "def f(v):\n    return v.mul_(2.0)",
        "y = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)",
    ),
    # a numpy view's methods named like out-of-place tensor methods write in place
    ("numpy-put-kept", "", "y = x.numpy().put(0, 5.0)"),
    ("numpy-view-put", "a = x.numpy()", "y = a.put(0, 5.0)"),
    ("numpy-view-sort", "a = x.detach().numpy()", "y = a.sort()"),
    ("numpy-dunder-array-put", "a = x.__array__()", "y = a.put(0, 5.0)"),
    ("numpy-view-in-container", "box = [x.numpy()]", "y = box[0].put(0, 5.0)"),
    ("numpy-view-through-loop", "", "for a in (x.numpy(),):\n    y = a.sort()"),
]

# Each case: (id, prelude, region). All must be accepted, and none changes `x` when run.
SAFE = [
    ("nothing", "", ""),
    ("metadata-shape", "", "n = x.shape\nm = n[0]"),
    ("metadata-size", "", "n = x.size(0)\nn += 1"),
    ("metadata-dtype", "", "n = x.dtype"),
    ("metadata-through-alias", "h = x.view(-1)", "n = h.size(0)\ns = h.shape"),
    ("metadata-feeds-fresh", "s = x.shape", "h = torch.zeros(s, dtype=torch.float64)\nh.add_(1.0)"),
    ("metadata-numel-dim", "", "n = x.numel() + x.dim()"),
    ("shape-rebound", "s = x.shape", "s = (1,)"),
    ("inplace-false-kw", "", "y = F.relu(x, inplace=False)"),
    ("inplace-false-positional", "", "y = F.hardtanh(x, -0.1, 0.1, False)"),
    ("pure-op", "", "y = x + 1.0\nz = torch.cat([x, x])"),
    ("pure-view-binding", "", "y = x.view(-1)\nz = x.transpose(0, 1)"),
    ("pure-builtin", "", "n = len(x)\nm = max(n, 2)"),
    ("linear-output", "h = self.p3(x)", "h.add_(1.0)"),
    ("linear-output-view", "h = self.p3(x).view(-1)", "h.add_(1.0)"),
    ("linear-output-chunks", "a, b = self.p3(x).chunk(2)", "a.add_(1.0)\nb[0] = 1.0"),
    ("linear-output-in-region", "", "y = self.p3(x)\ny[0] = 1.0"),
    ("linear-output-container", "c = [self.p3(x)]", "c[0].add_(1.0)"),
    ("linear-output-walrus", "", "(h := self.p3(x)).add_(1.0)"),
    ("linear-output-for", "", "for t in (self.p3(x),):\n    t.add_(1.0)"),
    ("literal", "h = 2.5", "h += 1.0"),
    ("new-tensor", "h = torch.zeros(4, dtype=torch.float64)", "h.add_(1.0)\nh[0] = 3.0"),
    ("unrelated-bound-method", "f = torch.zeros(2).add_", "f(1.0)"),
    ("unrelated-del", "h = torch.zeros(2)", "del h"),
    ("unrelated-out", "h = torch.zeros(4, 4, dtype=torch.float64)", "torch.neg(h, out=h)"),
    ("metadata-statement", "", "x.shape"),
    ("exec-outside-region", 'exec("pass")', ""),
    # spelled like the writers above, yet out of place
    ("tolist", "", "y = x.tolist()"),
    ("tensor-put-out-of-place", "", "y = x.put(torch.tensor([0]), torch.ones(1, dtype=x.dtype))"),
    (
        "index-put-out-of-place",
        "",
        "y = x.index_put((torch.tensor([0]),), torch.ones(1, dtype=x.dtype))",
    ),
    ("embedding-without-max-norm", "", "y = F.embedding(torch.tensor([0, 1]), x)"),
    ("embedding-max-norm-none", "", "y = F.embedding(torch.tensor([0, 1]), x, max_norm=None)"),
    (
        "batch-norm-eval",
        "",
        "y = F.batch_norm(torch.ones(3, 4, dtype=x.dtype), x[0], x[1].abs() + 1.0)",
    ),
    ("init-calculate-gain", "", "g = nn.init.calculate_gain('relu')"),
]


@pytest.mark.parametrize(("pre", "mid"), [c[1:] for c in WRITES], ids=[c[0] for c in WRITES])
def test_write_forms_are_refused(pre: str, mid: str) -> None:
    prog = program(pre, mid)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated `nn.init.*` say so
        assert actually_changes(prog), "the case must be a real hazard"
    assert not judged_stable(prog)


@pytest.mark.parametrize(("pre", "mid"), [c[1:] for c in SAFE], ids=[c[0] for c in SAFE])
def test_safe_forms_are_accepted(pre: str, mid: str) -> None:
    prog = program(pre, mid)
    assert not actually_changes(prog)
    assert judged_stable(prog)


FOREIGN_NAMESPACE = {**NAMESPACE, "np": numpy, "ctypes": ctypes}
"""The forward's globals plus numpy and ctypes: writers reached through other libraries."""


def run_foreign(prog: Program) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_programs.run` with `np` and `ctypes` bound: the inputs `p1` and `p2` saw."""
    namespace = dict(FOREIGN_NAMESPACE)
    exec(compile(prog.source, "<foreign forward>", "exec"), namespace)
    module = TwoProjections(Recorder)
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        namespace["forward"](module, x)
    return module.p1.seen[0], module.p2.seen[0]


# Each case: (id, prelude, region), with numpy and ctypes at hand. All write `x` through
# memory another library shares with it, with no in-place spelling; all must be refused.
FOREIGN_WRITES = [
    ("np-put", "", "y = np.put(x.numpy(), [0], [5.0])"),
    ("np-copyto", "", "y = np.copyto(x.numpy(), 0.5)"),
    ("np-ufunc-positional-out", "", "y = np.multiply(x.numpy(), 2.0, x.numpy())"),
    ("np-asarray-view-put", "a = np.asarray(x)", "y = a.put(0, 5.0)"),
    ("np-from-dlpack-put", "a = np.from_dlpack(x)", "y = a.put(0, 5.0)"),
    ("np-view-resize-free-sort", "a = x.numpy().reshape(-1)", "y = a.sort()"),
    ("memoryview-store", "m = memoryview(x.numpy())", "m[0, 0] = 5.0"),
    ("ctypes-memset", "p = x.data_ptr()", "y = ctypes.memset(p, 0, 8)"),
]


@pytest.mark.parametrize(
    ("pre", "mid"), [c[1:] for c in FOREIGN_WRITES], ids=[c[0] for c in FOREIGN_WRITES]
)
def test_writes_through_other_libraries_are_refused(pre: str, mid: str) -> None:
    prog = program(pre, mid)
    assert not unchanged(*run_foreign(prog)), "the case must be a real hazard"
    assert not judged_stable(prog)


@pytest.mark.parametrize(
    ("text", "writes"),
    [
        ("nn.init.constant(x, 0.5)", True),
        ("torch.nn.init.normal(x)", True),
        ("torch.utils.swap_tensors(x, y)", True),
        ("nn.utils.vector_to_parameters(v, [x])", True),
        ("torch.utils.checkpoint.checkpoint(f, x)", True),
        ("torch.vmap(f)", True),
        ("torch.native_batch_norm(x, w, b, m, v, True, 0.1, 1e-5)", True),
        ("F.embedding(i, w, max_norm=1.0)", True),
        ("F.embedding(i, w, None, 1.0)", True),
        ("F.embedding(i, w, *rest)", True),
        ("F.embedding(i, w, max_norm=m)", True),
        ("F.embedding(i, w)", False),
        ("F.embedding(i, w, max_norm=None)", False),
        ("F.embedding(i, w, 0, None)", False),
        ("torch.embedding(w, i)", True),  # a builtin: its signature is unreadable
        ("F.batch_norm(x, m, v)", False),
        ("F.batch_norm(x, m, v, training=False)", False),
        ("F.batch_norm(x, m, v, training=True)", True),
        ("F.batch_norm(x, m, v, None, None, t)", True),
        ("torch.batch_norm(x, w, b, m, v, False, 0.1, 1e-5, False)", True),  # unreadable
        ("F.instance_norm(x, m, v)", True),  # use_input_stats defaults to True
        ("F.instance_norm(x, m, v, use_input_stats=False)", False),
        ("torch.cat([x, y])", False),
        ("F.silu(x)", False),
        ("np.put(a, i, v)", False),  # not a pure namespace: known_pure decides
    ],
)
def test_namespace_call_writes(text: str, writes: bool) -> None:
    call = expr(text)
    assert isinstance(call, ast.Call)
    assert call_effects.namespace_call_writes(call) is writes


@pytest.mark.parametrize(
    ("text", "foreign"),
    [
        ("x", False),
        ("x.view(-1)", False),
        ("x.numpy()", True),
        ("x.detach().numpy()[0]", True),
        ("x.untyped_storage()", True),
        ("torch.Tensor.numpy(x)", True),
        ("np.asarray(x)", True),  # `np` is a global: any callee of it returns anything
        ("helper(x)", True),
        ("self.p3(x)", False),  # an nn.Linear returns a tensor
        ("self.p3", True),  # the module itself: its `float()` casts its parameters
        ("self.p3.weight", False),
        ("len(x)", False),
        ("min(a, x)", True),  # `a` holds a numpy view: `min` may hand it back
        ("(x.numpy(), 1)", True),
        ("x.numpy() * 2", False),  # arithmetic makes a new array
        ("[x.numpy()] + []", True),
    ],
)
def test_may_be_foreign(text: str, foreign: bool) -> None:
    found = call_effects.may_be_foreign(expr(text), TwoProjections(), {"a", "np", "helper"})
    assert found is foreign


def test_foreign_names_follow_bindings() -> None:
    funcdef = funcdef_of(
        """
        a = x.numpy()
        b = a
        box = []
        box.append(b)
        for item in box:
            pass
        c = x.view(-1)
        n = x.numpy().sum()
        y = np.zeros(3)
        """
    )
    found = alias.foreign_names(funcdef, TwoProjections())
    assert {"a", "b", "box", "item", "np", "n", "y"} <= found
    assert not {"x", "c", "self"} & found


def test_writes_outside_the_region_do_not_count() -> None:
    prog = program(pre="x.add_(1.0)\nh = x.view(-1)", post="h.mul_(2.0)\nx = x + 1")
    assert not actually_changes(prog)
    assert judged_stable(prog)


ALIAS_PROVIDES = frozenset({"operator", "wide", "contiguous", "no_grad"})
"""What `program`'s forward offers a shared write spelling: NAMESPACE's `operator`, a
contiguous 4 x 4 float64 input, run under no_grad (forward_programs.run)."""

DTYPE_DEPENDENT = {"float_cast_write"}
"""`x.float()` is `x` itself only for a float32 `x`: here (float64) it writes a copy, yet the
analysis, which cannot know the dtype, must still refuse it."""


@pytest.mark.parametrize("spelling", spellings(ALIAS_PROVIDES), ids=lambda spelling: spelling.label)
def test_every_shared_write_spelling_between_the_calls_is_refused(spelling: Spelling) -> None:
    """The write table the fuzzer and the piece-write tests use (tests/write_spellings.py),
    each spelling writing the input between the two projections."""
    prog = program(mid="\n".join(spelling.on("x")))
    if spelling.label not in DTYPE_DEPENDENT:
        assert actually_changes(prog), "the spelling must really write x"
    assert not judged_stable(prog)


# Cases the analysis must refuse although they cannot be run as a changing program (the
# rebinding is to a non-tensor, or the statement is an error at run time).
UNRUNNABLE_WRITES = [
    ("except-as", "try:\n    pass\nexcept ValueError as x:\n    pass"),
    ("import-as", "import math as x"),
    ("from-import-as", "from math import pi as x"),
    ("def", "def x():\n    pass"),
    ("class", "class x:\n    pass"),
    ("global", "global g"),
    ("globals", "globals()"),
    ("setattr-builtin", "setattr(self, 'a', 1)"),
    ("discarded-pure-call", "x.add(1.0)"),
    ("discarded-pure-call-nested", "if True:\n    torch.relu(x)"),
    ("distributed", "y = torch.distributed.all_reduce(x)"),
    ("custom-op", "y = torch.ops.mylib.scale(x)"),
    ("unknown-function", "y = helper(x)"),
    ("unknown-method", "y = x.custom_write()"),
    ("requires-grad", "x.requires_grad_(False)"),
    ("setattr-plain", "x.note = 1"),
]


@pytest.mark.parametrize(
    "mid", [c[1] for c in UNRUNNABLE_WRITES], ids=[c[0] for c in UNRUNNABLE_WRITES]
)
def test_unrunnable_write_forms_are_refused(mid: str) -> None:
    assert not judged_stable(program(mid=mid))


def test_refusal_names_the_written_alias() -> None:
    funcdef = program("h = x.view(-1)", "h.add_(1.0)").funcdef()
    expr, region = Program.region(funcdef)
    with pytest.raises(RewriteRefused, match="written: h"):
        check_input_stable(funcdef, TwoProjections(), expr, region)


def test_exec_refusal_says_why() -> None:
    funcdef = program(mid='exec("x.add_(1.0)")').funcdef()
    expr, region = Program.region(funcdef)
    with pytest.raises(RewriteRefused, match="exec/locals"):
        check_input_stable(funcdef, TwoProjections(), expr, region)
