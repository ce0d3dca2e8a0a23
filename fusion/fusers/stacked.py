"""The projection-stacking fusers' shared machinery: sibling linears reading one input
become one `MergedLinear` GEMM whose output the rewritten forward splits.

`check_plain_linear` and `check_stackable` prove, per instance, that the merged call computes
what the separate calls did (plain `nn.Linear`s, no hooks, no call path of their own, one
input width, dtype, device and parameter state). `rewrite_stacked` rewrites the class's
forward source, refusing unless alias analysis proves the shared input unchanged between
the calls, and makes a split piece an owned copy wherever the forward may write it or ask
its layout (`fusion.trace.pieces`, `fusion.analysis.piece_writes`). `StackedFuser` ties both to the
`Fuser` life cycle; `install_merged` swaps the children and registers the unfused
checkpoint layout.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import fx, nn

from fusion.analysis import regions, source
from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.analysis.piece_paths import unreplayed_layout_pieces
from fusion.analysis.piece_writes import written_pieces
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser
from fusion.fusers.pure_calls import check_input_stable_reading_calls, self_call_writes_nothing
from fusion.runtime import bound
from fusion.runtime.checkpoint import register_own_storages
from fusion.runtime.guards import attribute_guard
from fusion.runtime.merged import MergedLinear, restack_refusal
from fusion.trace.graph import is_linear, linear_calls, output_value
from fusion.trace.pieces import CONTIGUOUS, FRESH, OK, piece_verdicts
from fusion.trace.tracer import trace


def check_plain_linear(module: nn.Module, name: str) -> nn.Linear:
    """`module.<name>` if it is an `nn.Linear` whose forward is `nn.Linear.forward` and that
    carries no hooks; otherwise RewriteRefused naming the problem."""
    child = getattr(module, name, None)
    if not isinstance(child, nn.Linear):
        raise RewriteRefused(f"{name} is {type(child).__name__}, not nn.Linear")
    if type(child).forward is not nn.Linear.forward:
        raise RewriteRefused(f"{name} is {type(child).__name__}, an nn.Linear with its own forward")
    if "forward" in child.__dict__:
        raise RewriteRefused(f"{name} has an instance-level forward")
    call = own_call_path(child)
    if call:
        raise RewriteRefused(f"{name} is {type(child).__name__}, an nn.Linear with its own {call}")
    hooks = has_hooks(child)
    if hooks:
        raise RewriteRefused(f"{name} has {hooks}")
    return child


def check_stackable(
    module: nn.Module, names: tuple[str, ...], merged_name: str
) -> dict[str, nn.Linear]:
    """The named linears, once proven stackable into one `MergedLinear`: plain linears with
    one in_features, one weight dtype and device (bias dtype too), a free merged name, and
    plain Parameters that can become views of one stacked weight unobserved
    (`fusion.runtime.merged.restack_refusal`: nothing else uses their memory). Each keeps its own
    `requires_grad` and attributes: it stays the same Parameter."""
    if hasattr(module, merged_name):
        raise RewriteRefused(f"{type(module).__name__} already has an attribute {merged_name}")
    linears = {name: check_plain_linear(module, name) for name in names}
    first = next(iter(linears.values()))
    for name, linear in linears.items():
        if linear.in_features != first.in_features:
            raise RewriteRefused(
                f"{name} reads {linear.in_features} features, not {first.in_features}"
            )
        if linear.weight.dtype != first.weight.dtype:
            raise RewriteRefused(f"mixed dtypes across projections ({name}: {linear.weight.dtype})")
        if linear.weight.device != first.weight.device:
            raise RewriteRefused(
                f"mixed devices across projections ({name}: {linear.weight.device})"
            )
        if linear.bias is not None and (
            linear.bias.dtype != linear.weight.dtype or linear.bias.device != linear.weight.device
        ):
            raise RewriteRefused(f"{name} has a bias of another dtype or device")
    refusal = restack_refusal(
        tuple(linears),
        [(lin._parameters.get("weight"), lin._parameters.get("bias")) for lin in linears.values()],
        [lin.out_features for lin in linears.values()],
        first.in_features,
        tuple(lin.bias is not None for lin in linears.values()),
    )
    if refusal is not None:
        raise RewriteRefused(refusal)
    return linears


def _pure_input(expr: ast.expr) -> bool:
    """Is `expr` safe to evaluate once instead of several times (names, attributes, constant
    subscripts only: no calls, no walrus, no lambdas)?"""
    allowed = (ast.Name, ast.Attribute, ast.Load, ast.Subscript, ast.Constant, ast.Slice, ast.Tuple)
    return all(isinstance(node, allowed) for node in ast.walk(expr))


def _conditional_in_statement(stmt: ast.stmt, call: ast.Call) -> bool:
    """Is `call` evaluated only on some paths through `stmt` (inside a ternary branch whose
    test is not a constant, or beyond the first operand of `and`/`or`)?"""
    for node in ast.walk(stmt):
        if isinstance(node, ast.IfExp):
            if isinstance(node.test, ast.Constant):
                dead = node.orelse if node.test.value else node.body
                if source.contains(dead, call):
                    return True
                continue
            if source.contains(node.body, call) or source.contains(node.orelse, call):
                return True
        if isinstance(node, ast.BoolOp) and any(source.contains(v, call) for v in node.values[1:]):
            return True
    return False


_EXITS = (ast.Return, ast.Raise, ast.Break, ast.Continue, ast.Try, ast.Yield, ast.YieldFrom)


def rewrite_stacked(
    module: nn.Module,
    shards: tuple[str, ...],
    merged_name: str,
    contiguous: tuple[bool, ...] = (),
    fresh: tuple[bool, ...] = (),
) -> StackedRewrite:
    """Rewrite `type(module).forward` so the `shards` projections become one merged call.

    Split pieces flagged in `contiguous` become `.contiguous()`; those flagged in `fresh`,
    or that the rewritten source may write in place by any spelling, on any path, through
    any view or holder (`fusion.analysis.piece_writes.written_pieces`, which reads the helpers, methods and
    children the forward calls, and presumes a write where it cannot), or that it asks
    for their layout or returns, or that may meet a layout-sensitive use on a path the trace
    did not replay (`fusion.analysis.piece_paths.unreplayed_layout_pieces`: a `.view` under
    `if self.flag:`), become copies of their own (`settle_layouts`, which has
    the merged module hand out every piece laid out as needed).

    Returns the `StackedRewrite`. Refuses unless: each shard is called exactly once as
    `self.<shard>(input)` with the same side-effect-free input, every other reference to a
    shard is an existence guard (folded), the input is stable from the first call to the
    last (alias analysis, reading the calls between whose callees provably write nothing:
    `pure_calls.check_input_stable_reading_calls`), and, when calls sit inside branches, one
    call is reached unconditionally from the hoisting point, so the hoisted GEMM never runs on
    a path where its input was not a valid projection input, and every call runs in the
    region and global state it ran in (`fusion.analysis.regions.check_same_region`: no `with`
    around some calls but not all, nothing between that may change grad mode, autocast or
    other global state).
    """
    funcdef, fn = source.recover_forward(type(module))
    original = source.unparse(funcdef)
    calls = []
    for name in shards:
        call, refs = source.self_call_and_refs(funcdef, name)
        for ref in refs:
            source.fold_existence_guard(funcdef, ref, name)
        calls.append(call)
    inputs = [ast.dump(call.args[0]) for call in calls]
    if len(set(inputs)) != 1:
        raise RewriteRefused("projections are called on different input expressions")
    if not _pure_input(calls[0].args[0]):
        raise RewriteRefused("projection input expression has calls or side effects")
    block, indices = source.dominating_block(funcdef, calls)
    start = min(indices)
    relied = check_input_stable_reading_calls(
        funcdef,
        module,
        getattr(fn, "__globals__", {}),
        calls[0].args[0],
        block[start : max(indices) + 1],
    )
    # Regions are barriers: the merged call runs where the first call was, so no `with`
    # may hold some calls and not others, and nothing between may change global state.
    state_relied = regions.check_same_region(funcdef, calls, module, getattr(fn, "__globals__", {}))
    _check_unconditional_call(block, calls, indices, start)
    # Evaluation order: temporaries replace calls in source order, so the split order is the
    # shard order given, whatever order the calls appear in.
    temps = source.splice_merged_call(
        funcdef, calls, block, start, merged_name, contiguous=contiguous
    )
    _settle_pieces(funcdef, module, getattr(fn, "__globals__", {}), merged_name, temps, fresh)
    compiled = source.compile_forward(funcdef, fn)
    return StackedRewrite(compiled, original, source.unparse(funcdef), relied, state_relied)


def _check_unconditional_call(
    block: source.Block, calls: list[ast.Call], indices: list[int], start: int
) -> None:
    """Refuse unless some projection call runs unconditionally where the merged call goes
    (directly in `block`, in no conditional part of its statement) and control cannot leave
    `block` between the hoisting point `start` and the first such call."""
    anchors = [
        index
        for call, index in zip(calls, indices)
        if len(source.block_chain(block, call)) == 1  # directly in `block`, not nested
        and not _conditional_in_statement(block[index], call)
    ]
    if not anchors:
        raise RewriteRefused("no projection is called unconditionally where the merged call goes")
    if any(
        isinstance(node, _EXITS) for stmt in block[start : min(anchors)] for node in ast.walk(stmt)
    ):
        raise RewriteRefused("control can leave before an unconditional projection call")


def _settle_pieces(
    funcdef: ast.FunctionDef,
    module: nn.Module,
    namespace: dict[str, object],
    merged_name: str,
    temps: list[str],
    fresh: tuple[bool, ...],
) -> None:
    """Make copies of their own of the split pieces flagged `fresh`, written in place, or
    that may meet a layout-sensitive use the trace did not replay (`settle_layouts`)."""
    # Read with `module` and the forward's globals, so the calls it makes (helpers, q/k
    # norms, methods) are followed rather than presumed to write what they are passed.
    written = written_pieces(funcdef, temps, module, namespace)
    # A layout the replay chose holds on the traced path only: a piece that may meet a
    # layout-sensitive use elsewhere (`if self.flatten: q = q.view(-1)`) is a copy of its own.
    unreplayed = unreplayed_layout_pieces(funcdef, temps, module, namespace)
    flags = list(fresh) + [False] * (len(temps) - len(fresh))
    settle_layouts(
        funcdef,
        merged_name,
        temps,
        {t for t, f, w, u in zip(temps, flags, written, unreplayed) if f or w or u},
    )


@dataclass(frozen=True)
class StackedRewrite:
    """What `rewrite_stacked` returns: the compiled forward, the original and rewritten
    sources, the `self.<name>` calls proven to write nothing that the input-stability
    proof relied on (`fusion.fusers.pure_calls`), and those proven to keep global state
    that the region proof relied on (`fusion.analysis.regions`); both proven again per instance."""

    forward: Any
    original: str
    rewritten: str
    relied: tuple[str, ...] = ()
    state_relied: tuple[str, ...] = ()


def settle_layouts(
    funcdef: ast.FunctionDef, merged_name: str, temps: list[str], fresh: set[str]
) -> tuple[str, ...]:
    """Hand the pieces to the rewritten forward as its analysis asked, by the merged module
    itself: the split statement `t0, ... = self.<merged>(x).split(...)` becomes
    `t0, ... = self.<merged>(x, LAYOUTS)` (`MergedLinear.pieces`), each piece's layout
    `fresh` (in `fresh`: written in place, or its strides, storage or identity asked for;
    a copy of its own with standard strides, not a view, as the projection's own output
    was), `contiguous` (its use was `t.contiguous()`, which becomes `t`) or `view`.
    Returns the layouts.

    Safe because each temporary has exactly one use (the call it replaced) and no piece's
    values change between the split and that use (a piece written in place is `fresh`, so
    its writes reach no other piece): materialising at the split is materialising at the
    use. And it is cheaper where it matters: shards computed apart (the reference, a
    gradient, a trace) are the projections' own outputs, already fresh and contiguous, with
    no concatenation, split or copy (`MergedLinear.pieces`). Refuses when a temporary is not
    used exactly once (never expected: the rewrite would otherwise be unproven)."""
    uses: dict[str, list[tuple[ast.AST, str, int | None, ast.expr]]] = {t: [] for t in temps}
    # `t` inside `t.contiguous()`: that use is the call's, counted once, there
    receivers = {id(node.func.value) for node in ast.walk(funcdef) if _contiguous_call(node)}
    for node in ast.walk(funcdef):
        for field_name, value in ast.iter_fields(node):
            items = value if isinstance(value, list) else [value]
            for index, item in enumerate(items):
                target = item.func.value if _contiguous_call(item) else item
                if (
                    isinstance(target, ast.Name)
                    and isinstance(target.ctx, ast.Load)
                    and target.id in uses
                    and (target is not item or id(item) not in receivers)
                ):
                    where = index if isinstance(value, list) else None
                    uses[target.id].append((node, field_name, where, item))
    layouts = []
    for temp in temps:
        if len(uses[temp]) != 1:
            raise RewriteRefused(f"split piece {temp} is used {len(uses[temp])} times, not once")
        node, field_name, where, item = uses[temp][0]
        wrapped = isinstance(item, ast.Call)
        layouts.append("fresh" if temp in fresh else "contiguous" if wrapped else "view")
        if wrapped:
            bare = ast.copy_location(ast.Name(id=temp, ctx=ast.Load()), item)
            if where is None:
                setattr(node, field_name, bare)
            else:
                getattr(node, field_name)[where] = bare
    split = _split_statement(funcdef, merged_name)
    merged_call = split.value.func.value  # self.<merged>(x)
    call = ast.parse(f"self.{merged_name}(__input__, {tuple(layouts)!r})", mode="eval").body
    call.args[0] = merged_call.args[0]
    for part in ast.walk(call):
        ast.copy_location(part, split.value)
    split.value = call
    return tuple(layouts)


def _contiguous_call(node: ast.AST) -> bool:
    """Is `node` `name.contiguous()` (no arguments), how a split piece is used where the
    projection's contiguous output was needed (`source.splice_merged_call`)?"""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "contiguous"
        and not node.args
        and not node.keywords
        and isinstance(node.func.value, ast.Name)
    )


def _split_statement(funcdef: ast.FunctionDef, merged_name: str) -> ast.Assign:
    """The `... = self.<merged>(x).split(self.<merged>.output_sizes, -1)` statement that
    `source.splice_merged_call` inserted."""
    for node in ast.walk(funcdef):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "split"
            and isinstance(node.value.func.value, ast.Call)
            and isinstance(node.value.func.value.func, ast.Attribute)
            and node.value.func.value.func.attr == merged_name
        ):
            return node
    raise RewriteRefused(f"the split of self.{merged_name} is not in the rewritten forward")


@dataclass
class StackedFuser(Fuser):
    """Merge sibling projections into one `MergedLinear`; the forward splits its output."""

    moves_parameters: ClassVar[bool] = True
    changes_layout: ClassVar[bool] = False
    """The merged children stay in place with their own Parameters (views of the stacked
    weight), so a tensor-parallel plan keeps naming what exists; applying it puts hooks and
    DTensor Parameters on those children, which the rewritten forward's guards see (it then
    runs the original forward, so the plan's sharding computes as on the unfused model)."""

    shards: tuple[str, ...] = ()
    merged_name: str = ""
    forward_fn: Any = field(default=None, repr=False)
    relied: tuple[str, ...] = ()
    state_relied: tuple[str, ...] = ()

    def prepare(self, module: nn.Module, graph: fx.Graph, decided: bool = False) -> None:
        """Rewrite and compile the class's forward (once per class, by `match`).

        Refuses a shard that is an `nn.Linear` subclass with its own forward up front (child
        types are part of the cache key, so this holds for every instance sharing the match),
        and makes contiguous (or fresh) the split pieces whose uses need it
        (`fusion.trace.pieces`, `fusion.analysis.piece_writes`). On a `decided` graph (one path of several,
        `projection_graph`) every piece is made contiguous: uses on the other paths were
        never replayed (writes and layout questions on them are still read from source)."""
        for name in self.shards:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear) and type(child).forward is not nn.Linear.forward:
                raise RewriteRefused(
                    f"{name} is {type(child).__name__}, an nn.Linear with its own forward"
                )
            call = own_call_path(child) if isinstance(child, nn.Linear) else None
            if call:
                raise RewriteRefused(
                    f"{name} is {type(child).__name__}, an nn.Linear with its own {call}"
                )
            hooks = has_hooks(child) if isinstance(child, nn.Module) else None
            if hooks:
                raise RewriteRefused(f"{name} has {hooks}")
        by_target = {str(n.target): n for n in graph.nodes if n.op == "call_module"}
        nodes = [by_target[name] for name in self.shards]
        verdicts = (CONTIGUOUS,) * len(nodes) if decided else piece_verdicts(graph, module, nodes)
        rewrite = rewrite_stacked(
            module,
            self.shards,
            self.merged_name,
            contiguous=tuple(v != OK for v in verdicts),
            fresh=tuple(v == FRESH for v in verdicts),
        )
        self.forward_fn, self.relied = rewrite.forward, rewrite.relied
        self.state_relied = rewrite.state_relied
        self.original_source, self.rewritten_source = rewrite.original, rewrite.rewritten

    def validate(self, module: nn.Module) -> None:
        """Per instance: the shards stack (`check_stackable`), every call the class's
        input-stability proof read as writing nothing still does on this instance, and
        every call between the merged ones that the region proof read as keeping global
        state still does (its children's own children, hooks, methods and attributes may
        differ from the first's)."""
        check_stackable(module, self.shards, self.merged_name)
        for name in self.relied:
            if not self_call_writes_nothing(module, name):
                raise RewriteRefused(f"self.{name} may write the projection input on this instance")
        for name in self.state_relied:
            if not regions.self_call_keeps_state(module, name):
                raise RewriteRefused(
                    f"self.{name} may change global state (grad mode, autocast, settings) "
                    "between the merged calls on this instance"
                )

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        self.validate(module)
        linears = check_stackable(module, self.shards, self.merged_name)
        merged = MergedLinear.from_linears(linears, backend)
        install_merged(module, self.merged_name, merged)
        guards = [attribute_guard(module, self.merged_name, called=True)]
        guards += [attribute_guard(module, name) for name in self.shards]
        guards += [
            attribute_guard(module, n) for n in dict.fromkeys(self.relied + self.state_relied)
        ]
        bound.bind(module, self.forward_fn, tuple(guards))
        return module

    def dropped_children(self, module: nn.Module) -> tuple[str, ...]:
        return self.shards

    def describe(self) -> str:
        return f"{' + '.join(self.shards)} -> {self.merged_name}"


def install_merged(module: nn.Module, merged_name: str, merged: MergedLinear) -> None:
    """Put `merged` on `module` under `merged_name`. Its shards stay `module`'s children
    under their own names, with their own Parameters (now views of the merged weight), so
    the unfused checkpoint layout, parameter names and order are unchanged
    (`fusion.runtime.checkpoint` only gives each state-dict entry a storage object of its own)."""
    setattr(module, merged_name, merged)
    register_own_storages(module, merged_name)


def projection_graph(graph: fx.Graph | None, module: nn.Module) -> tuple[fx.Graph | None, bool]:
    """The graph a projection stacker matches on, and whether branches were decided in it.

    `graph` itself when the trace reached the return. When a branch on a traced value ended
    it (`if x.size(1) == 1`, an `assert` on a shape, a dtype test), a retrace that decides
    such branches (`fusion.trace.tracer.trace(..., decide_branches=True)`; if that still shows no
    linear call, one with optional arguments None), with True: that graph is one path of
    several. Sound for the stackers because the graph only proposes which
    linears read one value; `rewrite_stacked` proves the merge on the source, for every
    path (one call per shard, one pure input expression, unchanged from the first call to
    the last, a call reached unconditionally), and `prepare` replays no piece on it.
    """
    if graph is not None and output_value(graph) is not None:
        return graph, False
    decided = trace(module, decide_branches=True)
    if decided is None or not linear_calls(decided, module):
        # Still no projection: an optional argument left a proxy may have sent it down a
        # branch that ends it (`if mask is not None: x = x * mask`, then a shape splat).
        # Only then: with optional arguments None the path may differ in what matters
        # (a cross-attention's k/v would read the input), so a graph that shows
        # projections is never traded for it.
        defaults = trace(module, decide_branches=True, none_defaults=True)
        if defaults is not None and linear_calls(defaults, module):
            decided = defaults
    if decided is None:
        return graph, False
    return decided, True


def linear_inputs(graph: fx.Graph, module: nn.Module) -> dict[fx.Node, list[fx.Node]]:
    """Linear call nodes grouped by the node they read (single-argument calls only)."""
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if is_linear(node, module) and len(node.args) == 1 and not node.kwargs:
            arg = node.args[0]
            if isinstance(arg, fx.Node):
                groups.setdefault(arg, []).append(node)
    return groups


def unique_targets(nodes: list[fx.Node]) -> tuple[str, ...] | None:
    """Targets of `nodes` in order, or None when one child is called more than once."""
    targets = tuple(str(node.target) for node in nodes)
    return targets if len(set(targets)) == len(targets) else None


def width(module: nn.Module, name: str) -> int:
    child = getattr(module, name)
    return int(child.out_features) if isinstance(child, nn.Linear) else 0
