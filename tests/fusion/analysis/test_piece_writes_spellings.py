"""Every spelling of an in-place write to a split piece, in every split (found by tests/fuzz,
issue 18).

A piece of `merged.split(...)` is a view of a multi-output op: under autograd, writing it, or
any view of it, in place raises ("Output 0 of Transpose is a view and is being modified
inplace. This view is the output of a function that returns multiple views"), where the
projection's own output could be written. The fuzzer's shrunk example wrote a *derived* view
behind an existence guard, which the source analysis did not follow through the ternary:

    query_states = self.q_proj(h).view(shape).transpose(1, 2) if self.q_proj is not None else None
    query_states *= 0.5                   # RuntimeError in the fused forward (autograd on)

Each case here is one write spelling (augmented assignment, `_` methods, `out=`,
`inplace=`, item stores, rotary-style slice copies, through views, ternaries, `or`, walrus,
containers, loops, bound methods, lambdas, helpers, branches the trace did not take) on one
projection of one split: the QKV, sibling, gated-MLP (its gate/up as siblings) and MLA splits.
Each runs under `torch.no_grad()` (outputs must match the unfused module) and with autograd
on (outputs and the input gradient must match). The GLU fuser's own split happens inside
`ActAndMul`, so no piece reaches the forward; its cases write the fused product instead.

The modules are written to files (fusion reads forwards with `inspect.getsource`).
"""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from torch import nn

import fusion
from tests.write_spellings import HELPERS, Spelling, by_label

HEADER = (
    '''\
import operator

import torch
import torch.nn.functional as F
from torch import nn


def eager_attention_forward(module, query, key, value):
    """Stand-in attention (a tracer leaf): accepts any shapes."""
    return torch.cat([query.flatten(), key.flatten(), value.flatten()]) * 1.0, None


'''
    + HELPERS
)

SPLITS = {
    # name: (init lines, projection lines, tail lines, projected names, fuser)
    "qkv": (
        [
            "self.q_proj = nn.Linear(8, 8)",
            "self.k_proj = nn.Linear(8, 4)",
            "self.v_proj = nn.Linear(8, 4)",
        ],
        [
            "query_states = self.q_proj(x)",
            "key_states = self.k_proj(x)",
            "value_states = self.v_proj(x)",
        ],
        [
            "out, _ = eager_attention_forward(self, query_states, key_states, value_states)",
            "return out",
        ],
        ("query_states", "key_states", "value_states"),
        "qkv",
    ),
    "sibling": (
        [
            "self.a_proj = nn.Linear(8, 8)",
            "self.b_proj = nn.Linear(8, 4)",
            "self.o_proj = nn.Linear(12, 8)",
        ],
        ["a = self.a_proj(x)", "b = self.b_proj(x)"],
        ["return self.o_proj(torch.cat([a, b], dim=-1))"],
        ("a", "b"),
        "sibling",
    ),
    "glu_split": (
        [
            "self.gate_proj = nn.Linear(8, 8)",
            "self.up_proj = nn.Linear(8, 8)",
            "self.down_proj = nn.Linear(8, 8)",
            "self.act_fn = nn.SiLU()",
        ],
        ["gate = self.gate_proj(x)", "up = self.up_proj(x)"],
        ["return self.down_proj(self.act_fn(gate) * up)"],
        ("gate", "up"),
        "sibling",
    ),
    "mla": (
        [
            "self.q_proj = nn.Linear(8, 8)",
            "self.kv_a_proj = nn.Linear(8, 6)",
            "self.kv_b_proj = nn.Linear(4, 8)",
        ],
        ["q = self.q_proj(x)", "kv = self.kv_a_proj(x)"],
        [
            "k = self.kv_b_proj(kv[..., :4])",
            "out, _ = eager_attention_forward(self, q, k, kv)",
            "return out",
        ],
        ("q", "kv"),
        "mla",
    ),
}

WRITES: dict[str, Spelling] = by_label()
"""Every in-place write spelling of the shared table (tests/write_spellings.py), written to
a projection's output (`self.flag` is None in the traced instance and set in the checked
one, so a write under `if self.flag is not None` is on a path the trace did not take). A
piece stands for the projection's output, which is contiguous and at least 4 wide here, so
every spelling applies."""

UNTRACED = {"branch_not_traced", "helper_branch_not_traced"}
FLAG_READING = {"ternary_view", "boolop_view"}
"""Spellings that test `self.flag` themselves: they cannot also sit under it."""


def _source(
    split: str, write: str, target: int, chained: bool = False, untraced: bool = False
) -> str:
    init, projections, tail, names, _ = SPLITS[split]
    projections = list(projections)
    if chained:
        # The fuzzer's shape: a chained view of the projection, behind an existence guard.
        attr = projections[target].split("self.")[1].split("(")[0]
        call = projections[target].split(" = ")[1]
        projections[target] = (
            f"{names[target]} = {call}.unflatten(-1, (2, -1)).transpose(0, 1)"
            f" if self.{attr} is not None else None"
        )
    writes = list(WRITES[write].on(names[target]))
    if untraced:
        # Only the source shows the write: the traced instance has no flag.
        writes = ["if self.flag is not None:", *(f"    {line}" for line in writes)]
    body = [*projections, *writes, *tail]
    lines = [
        "class Block(nn.Module):",
        "    def __init__(self, flag=None):",
        "        super().__init__()",
        *(f"        {line}" for line in init),
        "        self.flag = flag",
        "",
        "    def forward(self, x):",
        *(f"        {line}" for line in body),
    ]
    return HEADER + "\n\n" + "\n".join(lines) + "\n"


def _fused(module: nn.Module, traced: nn.Module, fuser: str) -> nn.Module:
    """A fused copy of `module`, its class matched on `traced` first (the instance whose
    trace the class-level match keeps)."""
    assert fusion.fuse(copy.deepcopy(traced)).applied
    fused = copy.deepcopy(module)
    report = fusion.fuse(fused)
    # A spelling fx cannot trace (`torch.Tensor.mul_(q, s)`) leaves the attention call
    # unseen: the sibling fuser, which needs no trace past the projections, takes the split.
    assert [record.fuser for record in report.applied] in ([fuser], ["sibling"]), report
    return fused


def _check(module: nn.Module, fused: nn.Module) -> None:
    """Under `torch.no_grad()` and with autograd on: the same output (with autograd, the
    same input gradient too) as the unfused module, and the fused forward runs wherever the
    unfused one does."""
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = module(x.clone())
        torch.testing.assert_close(fused(x.clone()), expected, rtol=1e-5, atol=1e-6)
    a_in, b_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    try:
        a = module(a_in)
    except RuntimeError as exc:  # `out=` under autograd: the original raises too
        with pytest.raises(RuntimeError, match=str(exc).split(":")[0]):
            fused(b_in)
        return
    b = fused(b_in)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(b_in.grad, a_in.grad, rtol=1e-5, atol=1e-6)


CASES = [
    pytest.param(split, write, target, id=f"{split}-{write}-{target}")
    for split in SPLITS
    for write in WRITES
    for target in range(len(SPLITS[split][3]))
    if not (split == "qkv" and target == 2 and write not in {"augassign_mul", "item_assign"})
]


@pytest.mark.slow  # about 1,200 cases, a minute on two cores: CI's slow step runs them
@pytest.mark.parametrize("untraced", [False, True], ids=["traced", "untraced"])
@pytest.mark.parametrize(("split", "write", "target"), CASES)
def test_written_piece_behaves_like_the_projection_output(
    load, split: str, write: str, target: int, untraced: bool
) -> None:
    """`untraced`: the write sits in a branch the traced instance does not take, so the
    replay cannot see it and only the source analysis can."""
    if untraced and write in UNTRACED | FLAG_READING:
        pytest.skip("already on an untraced path, or reads the flag")
    module_type = load(_source(split, write, target, untraced=untraced))
    torch.manual_seed(0)
    module = module_type.Block(flag=1.0 if untraced or write in UNTRACED else None)
    traced = module_type.Block(flag=None)
    _check(module, _fused(module, traced, SPLITS[split][4]))


@pytest.mark.parametrize(
    "write", ["augassign_mul", "inplace_method", "item_assign", "rotary_copy_", "walrus_write"]
)
@pytest.mark.parametrize("split", ["qkv", "mla"])
def test_chained_guarded_projection_written(load, split: str, write: str) -> None:
    """The fuzzer's example: a chained view of the projection behind an existence guard
    (`q = self.q_proj(h).view(...).transpose(...) if self.q_proj is not None else None`),
    then written."""
    module_type = load(_source(split, write, 0, chained=True))
    torch.manual_seed(0)
    module = module_type.Block()
    _check(module, _fused(module, module, SPLITS[split][4]))


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize(
    "write",
    [
        *("augassign_mul", "ternary_view", "dict_container", "operator_function", "helper_rotary"),
        *("init_deprecated", "embedding_max_norm"),
    ],
)
@pytest.mark.filterwarnings("ignore::FutureWarning")  # the deprecated `nn.init.constant`
def test_untraced_writes_quick(load, split: str, write: str) -> None:
    """A quick subset of the matrix above for the default selection: spellings the source
    analysis missed before issue 18 (and, with no in-place spelling at all, before issue 24),
    on a path the trace did not take where possible."""
    untraced = write not in FLAG_READING
    module_type = load(_source(split, write, 0, untraced=untraced))
    torch.manual_seed(0)
    module = module_type.Block(flag=1.0 if untraced else None)
    _check(module, _fused(module, module_type.Block(flag=None), SPLITS[split][4]))


def test_the_shrunk_fuzzer_example(load) -> None:
    """Issue 18's example verbatim (heads as views, `*=` on the transposed query)."""
    module_type = load(
        HEADER
        + textwrap.dedent(
            """

            class Block(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.head_dim = 4
                    self.q_proj = nn.Linear(8, 8)
                    self.k_proj = nn.Linear(8, 4)
                    self.v_proj = nn.Linear(8, 4)

                def forward(self, hidden_states):
                    input_shape = hidden_states.shape[:-1]
                    hidden_shape = (*input_shape, -1, self.head_dim)
                    query_states = (
                        self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
                        if self.q_proj is not None
                        else None
                    )
                    query_states *= 0.5
                    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
                    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
                    out, _ = eager_attention_forward(self, query_states, key_states, value_states)
                    return out
            """
        )
    )
    module = module_type.Block()
    fused = _fused(module, module, "qkv")
    _check(module, fused)


GLU_WRITES = [
    "augassign_mul",
    "inplace_method",
    "item_assign",
    "rotary_copy_",
    "helper_discarded",
]


@pytest.mark.parametrize("inplace_act", [False, True], ids=["act", "act_inplace"])
@pytest.mark.parametrize("write", GLU_WRITES)
def test_glu_product_written(load, write: str, inplace_act: bool) -> None:
    """The GLU fuser splits inside `ActAndMul`: the forward sees only the fused product,
    a fresh tensor, which it may write; an in-place activation wrote the gate GEMM's own
    output in the original, and nothing the forward can see in the fused one."""
    act = "nn.SiLU(inplace=True)" if inplace_act else "nn.SiLU()"
    body = [
        "h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)",
        *WRITES[write].on("h"),
        "return self.down_proj(h)",
    ]
    text = (
        HEADER
        + "\n\n"
        + "\n".join(
            [
                "class Block(nn.Module):",
                "    def __init__(self):",
                "        super().__init__()",
                "        self.gate_proj = nn.Linear(8, 8)",
                "        self.up_proj = nn.Linear(8, 8)",
                "        self.down_proj = nn.Linear(8, 8)",
                f"        self.act_fn = {act}",
                "",
                "    def forward(self, x):",
                *(f"        {line}" for line in body),
            ]
        )
    )
    module_type = load(text + "\n")
    module = module_type.Block()
    _check(module, _fused(module, module, "glu"))


@pytest.mark.parametrize("kind", ["staticmethod", "method", "child"])
def test_write_in_a_method_or_child(load, kind: str) -> None:
    """A write inside a method of `self` (static or not) or a child's forward, on a path
    the trace did not take: read from the callee's source, with its parameters bound."""
    call = {
        "staticmethod": "self.scale(1.0, query_states)",
        "method": "self.scale(1.0, query_states)",
        "child": "self.scaler(1.0, query_states)",
    }[kind]
    decorator = "    @staticmethod\n" if kind == "staticmethod" else ""
    params = "factor, t" if kind == "staticmethod" else "self, factor, t"
    module_type = load(
        HEADER
        + "\n\nclass Scaler(nn.Module):\n"
        + "    def forward(self, factor, t):\n        t.mul_(factor * 0.5)\n        return t\n"
        + "\n\nclass Block(nn.Module):\n"
        + "    def __init__(self, flag=None):\n        super().__init__()\n"
        + "        self.q_proj = nn.Linear(8, 8)\n        self.k_proj = nn.Linear(8, 4)\n"
        + "        self.v_proj = nn.Linear(8, 4)\n        self.scaler = Scaler()\n"
        + "        self.flag = flag\n\n"
        + f"{decorator}    def scale({params}):\n        t.mul_(factor * 0.5)\n        return t\n\n"
        + "    def forward(self, x):\n"
        + "        query_states = self.q_proj(x)\n        key_states = self.k_proj(x)\n"
        + "        value_states = self.v_proj(x)\n"
        + f"        if self.flag is not None:\n            {call}\n"
        + "        out, _ = eager_attention_forward(self, query_states, key_states, value_states)\n"
        + "        return out\n"
    )
    module = module_type.Block(flag=1.0)
    _check(module, _fused(module, module_type.Block(), "qkv"))


def test_reading_calls_keeps_pieces_views(load) -> None:
    """Calls that only read (a helper returning new tensors, a q/k norm through a view, an
    attention interface) cost no copy: the analysis reads them instead of presuming a write."""
    module_type = load(
        HEADER
        + textwrap.dedent(
            """

            def rotate_half(x):
                x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
                return torch.cat((-x2, x1), dim=-1)


            def apply_rotary(q, k):
                return q * 0.5 + rotate_half(q), k * 0.5 + rotate_half(k)


            class Block(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.q_proj = nn.Linear(8, 8)
                    self.k_proj = nn.Linear(8, 4)
                    self.v_proj = nn.Linear(8, 4)
                    self.q_norm = nn.RMSNorm(4)

                def forward(self, x):
                    q = self.q_norm(self.q_proj(x).unflatten(-1, (2, 4)))
                    k = self.k_proj(x)
                    v = self.v_proj(x)
                    q, k = apply_rotary(q, k)
                    q *= 0.5  # a new tensor by now: no piece is written
                    out, _ = eager_attention_forward(self, q, k, v)
                    return out
            """
        )
    )
    module = module_type.Block()
    fused = copy.deepcopy(module)
    report = fusion.fuse(fused)
    qkv = [record for record in report.applied if record.fuser == "qkv"]
    assert qkv, report
    assert ".copy_(" not in (qkv[0].rewritten_source or "")
    _check(module, fused)
