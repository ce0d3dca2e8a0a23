"""A Hypothesis grammar of straight-line forwards that may or may not disturb their input.

Every generated forward reads one input tensor `x` and calls two projections on it:

    def forward(self, x):
        <prelude: aliases, containers, closures, fresh values, writes>
        _r1 = self.p1(x)
        <region: more of the same>
        _r2 = self.p2(x)
        <epilogue>
        return _r1, _r2

The statements come from a small grammar of the hazards a merged projection must respect:
views and slices, fresh values (a linear's output, literals, copies), in-place methods,
`out=`, `inplace=` (keyword and positional), trailing-underscore functions, item and
attribute assignment, rebinding and `del`, walrus, loop targets, containers, bound methods,
closures, shadowed builtins, `match` captures, `exec`/`eval`/`locals()`, operator and dunder
spellings, and statements nested in `if`/`for`/`with` blocks; and every write spelling of the
table the fuzzer and the piece-write tests share (tests/write_spellings.py), so the three
families test one grammar of hazards.

The generator tracks every name's shape and contiguity so each program runs without error
(shape-changing in-place ops are left out on purpose: they would make tracking unsound).
Whether the input actually changes is decided by running the program, never by the
generator: the grammar only has to be broad.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from tests.write_spellings import spellings

IN_FEATURES = 4
"""Width the projections read: `x` and every rebinding of it keep this last dimension."""


@dataclass(frozen=True)
class TensorVar:
    shape: tuple[int, ...]
    contiguous: bool = True

    @property
    def projectable(self) -> bool:
        return len(self.shape) >= 1 and self.shape[-1] == IN_FEATURES


@dataclass(frozen=True)
class ContainerVar:
    kind: str  # "list", "tuple" or "dict"
    items: tuple[TensorVar, ...]

    def keys(self) -> list[str]:
        if self.kind == "dict":
            return [repr(f"k{i}") for i in range(len(self.items))]
        return [str(i) for i in range(len(self.items))]


@dataclass(frozen=True)
class CallableVar:
    kind: str  # "inplace0" f(), "inplace1" f(t), "pure1" f(s) -> tensor, "alias0" f() -> tensor
    result: TensorVar | None = None


@dataclass(frozen=True)
class SnapshotVar:
    """`locals()` taken earlier: the tensor names (and shapes) it holds."""

    names: tuple[tuple[str, TensorVar], ...]


@dataclass(frozen=True)
class OtherVar:
    """A value that holds no tensor storage (a shape, a dtype, a number, a module)."""


Var = TensorVar | ContainerVar | CallableVar | SnapshotVar | OtherVar

GRAMMAR_PROVIDES = frozenset({"operator", "wide", "contiguous", "no_grad"})
"""What a generated forward offers a shared write spelling (`Spelling.needs`): the `operator`
of `forward_programs.NAMESPACE`, contiguous tensors IN_FEATURES wide, execution under no_grad
(`forward_programs.run`)."""

SHADOWABLE = ("abs", "min")
"""Builtin names a forward may rebind locally (never used otherwise by the grammar)."""


@dataclass
class Gen:
    """Generation state: the drawing function, the environment, and the name counter."""

    draw: Any
    env: dict[str, Var] = field(default_factory=lambda: {"x": TensorVar((4, 4))})
    attrs: dict[str, TensorVar] = field(default_factory=dict)
    """Tensors stored on the module (`self.s1 = t`), readable as `self.s1`."""
    counter: int = 0

    # -- choices ---------------------------------------------------------------------------

    def pick(self, options: list[Any]) -> Any:
        return self.draw(st.sampled_from(options))

    def names(self, kind: type) -> list[str]:
        # `x` first: shrinking moves towards the input itself.
        return sorted((n for n, v in self.env.items() if isinstance(v, kind)), key=_name_order)

    def fresh_name(self) -> str:
        self.counter += 1
        return f"v{self.counter}"

    def target(self, value: Var) -> str:
        """A name to bind `value` to: usually new, sometimes an existing one (rebinding),
        the input included when the value can still be projected."""
        candidates = [self.fresh_name()]
        rebindable = [n for n in self.env if n not in SHADOWABLE]
        if not (isinstance(value, TensorVar) and value.projectable):
            rebindable = [n for n in rebindable if n != "x"]
        candidates += rebindable
        if self.draw(st.integers(0, 3)) == 0:
            return self.pick(candidates)
        return candidates[0]

    def tensor_expr(self, *, allow_elements: bool = True) -> tuple[str, TensorVar]:
        """A tensor-valued expression: a name or, sometimes, a container element."""
        options: list[tuple[str, TensorVar]] = [(n, self.env[n]) for n in self.names(TensorVar)]
        if allow_elements:
            for name in self.names(ContainerVar):
                container = self.env[name]
                assert isinstance(container, ContainerVar)
                for key, item in zip(container.keys(), container.items):
                    options.append((f"{name}[{key}]", item))
            options += [(f"self.{attr}", var) for attr, var in sorted(self.attrs.items())]
        return self.pick(options)

    def tensor_name(self) -> tuple[str, TensorVar]:
        name = self.pick(self.names(TensorVar))
        return name, self.env[name]

    # -- statements ------------------------------------------------------------------------

    def statement(self, depth: int = 0) -> list[str]:
        forms = [
            self.s_metadata,
            self.s_fresh,
            self.s_copy,
            self.s_view,
            self.s_alias,
            self.s_container,
            self.s_unpack,
            self.s_inplace_method,
            self.s_augassign,
            self.s_out,
            self.s_inplace_kw,
            self.s_underscore_fn,
            self.s_item_assign,
            self.s_discarded,
            self.s_bound_method,
            self.s_closure,
            self.s_call,
            self.s_walrus,
            self.s_for,
            self.s_comprehension,
            self.s_container_mutation,
            self.s_dunder,
            self.s_reflection,
            self.s_del,
            self.s_match,
            self.s_shadow,
            self.s_set_storage,
            self.s_attribute,
            self.s_with,
            self.s_star_unpack,
            self.s_shared_write,
        ]
        if depth == 0:
            forms.append(self.s_nested)
        while True:
            lines = self.pick(forms)()
            if lines:
                return lines

    def s_shared_write(self) -> list[str]:
        """One write spelling of the table the fuzzer and the piece-write tests share
        (tests/write_spellings.py), on a contiguous tensor at least 4 wide."""
        names = [
            n
            for n in self.names(TensorVar)
            if self.env[n].contiguous and self.env[n].projectable  # type: ignore[union-attr]
        ]
        if not names:
            return []
        spelling = self.pick(list(spellings(GRAMMAR_PROVIDES)))
        return list(spelling.on(self.pick(names)))

    def s_metadata(self) -> list[str]:
        t, var = self.tensor_expr()
        reads = [f"{t}.shape", f"{t}.dtype", f"{t}.numel()", f"{t}.dim()", f"{t}.is_contiguous()"]
        if var.shape:
            reads += [f"{t}.size(0)", f"{t}.shape[-1]", f"len({t})"]
        name = self.fresh_name()
        self.env[name] = OtherVar()
        return [f"{name} = {self.pick(reads)}"]

    def s_fresh(self) -> list[str]:
        """A value sharing no storage with anything bound: a linear's output (and chains of
        methods on it), a new tensor, a literal."""
        choices: list[tuple[str, Var]] = [
            ("torch.zeros(4, 4, dtype=torch.float64)", TensorVar((4, 4))),
            ("torch.ones(2, 4, dtype=torch.float64)", TensorVar((2, 4))),
            ("2.5", OtherVar()),
        ]
        t, var = self.tensor_expr()
        if var.projectable:
            out = TensorVar(var.shape)
            numel = _numel(var.shape)
            choices += [
                (f"self.p3({t})", out),
                (f"self.p3({t}).view(-1)", TensorVar((numel,))),
                (f"self.p3({t}).float().double()", out),
            ]
            if len(var.shape) >= 2:
                choices.append(
                    (f"self.p3({t}).transpose(0, -1)", TensorVar(out.shape[::-1], False))
                )
            u, uvar = self.tensor_expr()
            # Methods whose result shares storage with an *argument*, not the receiver.
            choices += [(f"self.p3({t}).set_({u})", uvar), (f"self.p3({t}).new({u})", uvar)]
        expr, value = self.pick(choices)
        return self._assign(expr, value)

    def _assign(self, expr: str, value: Var) -> list[str]:
        name = self.target(value)
        self.env[name] = value
        return [f"{name} = {expr}"]

    def s_copy(self) -> list[str]:
        t, var = self.tensor_expr()
        expr = self.pick(
            [
                f"{t}.clone()",
                f"{t} + 1.0",
                f"{t} * 2.0",
                f"torch.relu({t})",
                f"F.relu({t}, inplace=False)",
                f"F.hardtanh({t}, -0.1, 0.1, False)",
                f"torch.ones_like({t})",
            ]
        )
        return self._assign(expr, TensorVar(var.shape))

    def s_view(self) -> list[str]:
        t, var = self.tensor_expr()
        shape, numel = var.shape, _numel(var.shape)
        views: list[tuple[str, TensorVar]] = [
            (f"{t}.reshape(-1)", TensorVar((numel,), False)),
            (f"{t}.unsqueeze(0)", TensorVar((1, *shape), var.contiguous)),
            (f"{t}.detach()", var),
            (f"{t}.data", var),
            (f"{t}.expand_as({t})", var),
            (f"{t}.contiguous()", TensorVar(shape)),
            (f"{t}.to(torch.float64)", var),
            (f"{t}[...]", var),
            (f"torch.flatten({t})", TensorVar((numel,), False)),
        ]
        if var.contiguous:
            views += [(f"{t}.view(-1)", TensorVar((numel,))), (f"{t}.view_as({t})", var)]
        if shape:
            views += [
                (f"{t}[0]", TensorVar(shape[1:], var.contiguous)),
                (f"{t}.narrow(0, 0, 1)", TensorVar((1, *shape[1:]), var.contiguous)),
                (f"torch.select({t}, 0, 0)", TensorVar(shape[1:], var.contiguous)),
                (f"{t}.unbind(0)[-1]", TensorVar(shape[1:], var.contiguous)),
            ]
            if shape[0] >= 2:
                views.append((f"{t}[1:]", TensorVar((shape[0] - 1, *shape[1:]), var.contiguous)))
            if shape[-1] >= 2:
                views.append(
                    (
                        f"{t}[..., :2]",
                        TensorVar((*shape[:-1], 2), len(shape) == 1 and var.contiguous),
                    )
                )
        if len(shape) >= 2:
            views += [
                (f"{t}.transpose(0, -1)", TensorVar(shape[::-1], False)),
                (f"{t}.mT", TensorVar((*shape[:-2], shape[-1], shape[-2]), False)),
            ]
        expr, value = self.pick(views)
        return self._assign(expr, value)

    def s_alias(self) -> list[str]:
        t, var = self.tensor_expr()
        u, uvar = self.tensor_expr()
        expr, value = self.pick(
            [
                (t, var),
                (f"{t} if True else {u}", var),
                (f"{t} if False else {u}", uvar),
                (f"{t} if len(x) > 0 else {u}", var),
                (f"({t}, {u})[0]", var),
                (f"max([{t}], key=lambda e: e.add_(1.0).sum())", var),
                (f"{t} or {u}", var) if _numel(var.shape) == 1 else (t, var),
            ]
        )
        return self._assign(expr, value)

    def s_container(self) -> list[str]:
        t, var = self.tensor_expr()
        u, uvar = self.tensor_expr()
        kind = self.pick(["list", "tuple", "dict"])
        items = (var, uvar)
        if kind == "list":
            expr = f"[{t}, {u}]"
        elif kind == "tuple":
            expr = f"({t}, {u})"
        else:
            expr = f"{{'k0': {t}, 'k1': {u}}}"
        return self._assign(expr, ContainerVar(kind, items))

    def s_unpack(self) -> list[str]:
        t, var = self.tensor_expr()
        a, b = self.fresh_name(), self.fresh_name()
        options: list[tuple[str, TensorVar, TensorVar]] = []
        u, uvar = self.tensor_expr()
        options.append((f"{t}, {u}", var, uvar))
        if var.shape and var.shape[0] % 2 == 0:
            half = TensorVar((var.shape[0] // 2, *var.shape[1:]), var.contiguous)
            options += [
                (f"{t}.chunk(2)", half, half),
                (f"torch.split({t}, {half.shape[0]})", half, half),
            ]
        if var.shape and var.shape[0] == 2:
            row = TensorVar(var.shape[1:], var.contiguous)
            options.append((f"{t}.unbind(0)", row, row))
        if var.projectable:
            out = TensorVar(var.shape)
            options.append((f"self.p3({t}), {t}", out, var))
        expr, avar, bvar = self.pick(options)
        self.env[a], self.env[b] = avar, bvar
        return [f"{a}, {b} = {expr}"]

    def s_inplace_method(self) -> list[str]:
        t, _var = self.tensor_expr()
        call = self.pick(
            [
                "add_(1.0)",
                "mul_(2.0)",
                "neg_()",
                "fill_(3.0)",
                "zero_()",
                "sub_(0.5)",
                "clamp_(min=0.5)",
                f"copy_({t} * 2.0 + 1.0)",
                "requires_grad_(False)",
            ]
        )
        return [f"{t}.{call}"]

    def s_augassign(self) -> list[str]:
        t, _ = self.tensor_expr()
        container = self.env.get(t.split("[")[0])
        if isinstance(container, ContainerVar) and container.kind == "tuple":
            return []  # `tup[0] += 1` raises after the in-place add; keep programs runnable
        return [f"{t} {self.pick(['+=', '*=', '-='])} {self.pick(['1.0', '2.0'])}"]

    def s_out(self) -> list[str]:
        t, var = self.tensor_expr()
        source = self.pick([f"{t}", f"torch.ones_like({t})"])
        fn = self.pick(
            [
                "torch.add({s}, 1.0, out={t})",
                "torch.mul({s}, 2.0, out={t})",
                "torch.neg({s}, out={t})",
            ]
        )
        line = fn.format(s=source, t=t)
        if self.draw(st.booleans()):
            return self._assign(line, var)
        return [line]

    def s_inplace_kw(self) -> list[str]:
        t, var = self.tensor_expr()
        call = self.pick(
            [
                f"F.relu({t}, inplace=True)",
                f"F.relu({t}, True)",
                f"F.hardtanh({t}, -0.1, 0.1, inplace=True)",
                f"F.hardtanh({t}, -0.1, 0.1, True)",
                f"F.threshold({t}, 0.0, 5.0, True)",
                f"F.leaky_relu({t}, 0.2, True)",
                f"F.leaky_relu({t}, 0.2, inplace=True)",
                f"nn.functional.elu({t}, 1.0, True)",
                f"F.hardtanh({t}, -0.1, 0.1, inplace=False)",
                f"F.relu({t}, inplace=False)",
            ]
        )
        if self.draw(st.booleans()):
            return self._assign(call, var)
        return [call]

    def s_underscore_fn(self) -> list[str]:
        t, var = self.tensor_expr()
        call = self.pick(
            [
                f"torch.relu_({t})",
                f"torch.sigmoid_({t})",
                f"torch.clamp_({t}, min=0.5)",
                f"nn.init.constant_({t}, 2.0)",
                f"torch.nn.init.zeros_({t})",
                f"torch.Tensor.add_({t}, 1.0)",
                f"torch.ops.aten.add_.Scalar({t}, 1.0)",
            ]
        )
        if self.draw(st.booleans()):
            return self._assign(call, var)
        return [call]

    def s_item_assign(self) -> list[str]:
        t, var = self.tensor_expr()
        options = [f"{t}[...] = 9.0", f"{t}[...] = {t} * 3.0"]
        if var.shape:
            options.append(f"{t}[0] = 5.0")
        # Writes through a call result: a view returned by a function, not a method.
        options += [f"torch.flatten({t})[0] = 7.0", f"({t} if True else None)[...] = 6.0"]
        return [self.pick(options)]

    def s_discarded(self) -> list[str]:
        t, _ = self.tensor_expr()
        return [self.pick([f"{t}.add(1.0)", f"torch.relu({t})", f"{t}.sum()", f"{t}.shape"])]

    def s_bound_method(self) -> list[str]:
        t, var = self.tensor_expr()
        kind = self.pick(["inplace", "pure"])
        if kind == "inplace":
            method = self.pick(["add_", "mul_", "sub_"])
            return self._assign(f"{t}.{method}", CallableVar("inplace_arg", None))
        return self._assign(f"{t}.mul", CallableVar("pure_arg", TensorVar(var.shape)))

    def s_closure(self) -> list[str]:
        t, var = self.tensor_expr()
        name = self.fresh_name()
        options: list[tuple[list[str], CallableVar]] = [
            ([f"{name} = lambda: {t}.add_(1.0)"], CallableVar("inplace0")),
            ([f"{name} = lambda v: v.mul_(2.0)"], CallableVar("inplace1")),
            ([f"{name} = lambda: {t}"], CallableVar("alias0", var)),
            ([f"def {name}():", f"    {t}.neg_()"], CallableVar("inplace0")),
            ([f"def {name}():", f"    return {t}"], CallableVar("alias0", var)),
            ([f"{name} = getattr({t}, 'add_')"], CallableVar("inplace_arg")),
        ]
        lines, value = self.pick(options)
        self.env[name] = value
        return lines

    def s_call(self) -> list[str]:
        names = self.names(CallableVar)
        if not names:
            return []
        f = self.pick(names)
        var = self.env[f]
        assert isinstance(var, CallableVar)
        if var.kind == "inplace0":
            return [f"{f}()"] if self.draw(st.booleans()) else self._assign(f"{f}()", OtherVar())
        if var.kind == "alias0":
            assert var.result is not None
            return self._assign(f"{f}()", var.result)
        if var.kind == "inplace_arg":
            return (
                [f"{f}(1.0)"] if self.draw(st.booleans()) else self._assign(f"{f}(2.0)", OtherVar())
            )
        if var.kind == "pure_arg":
            assert var.result is not None
            return self._assign(f"{f}(2.0)", var.result)
        t, tvar = self.tensor_expr()
        return [f"{f}({t})"] if self.draw(st.booleans()) else self._assign(f"{f}({t})", tvar)

    def s_walrus(self) -> list[str]:
        t, var = self.tensor_expr()
        name = self.fresh_name()
        if self.draw(st.booleans()):
            self.env[name] = var
            return [f"({name} := {t}).mul_(2.0)"]
        other = self.fresh_name()
        self.env[name] = var
        self.env[other] = var
        return [f"{other} = ({name} := {t})"]

    def s_for(self) -> list[str]:
        t, _var = self.tensor_expr()
        u, uvar = self.tensor_expr()
        name = self.target(uvar)
        body = self.pick(["pass", f"{name}.add_(1.0)", f"{name} = {name} * 2.0"])
        self.env[name] = uvar
        return [f"for {name} in ({t}, {u}):", f"    {body}"]

    def s_comprehension(self) -> list[str]:
        t, var = self.tensor_expr()
        u, uvar = self.tensor_expr()
        element = self.pick(["e * 2.0", "e", "e.add_(1.0)"])
        items = (var, uvar)
        if element == "e * 2.0":
            items = (TensorVar(var.shape), TensorVar(uvar.shape))
        return self._assign(f"[{element} for e in ({t}, {u})]", ContainerVar("list", items))

    def s_container_mutation(self) -> list[str]:
        mutable = [
            n
            for n in self.names(ContainerVar)
            if getattr(self.env[n], "kind", None) in ("list", "dict")
        ]
        if not mutable:
            return []
        c = self.pick(mutable)
        container = self.env[c]
        assert isinstance(container, ContainerVar)
        t, var = self.tensor_expr(allow_elements=False)
        key = self.pick(container.keys())
        replaced = list(container.items)
        replaced[container.keys().index(key)] = var
        options: list[tuple[str, list[TensorVar]]] = [(f"{c}[{key}] = {t}", replaced)]
        if container.kind == "list":
            options += [
                (f"{c}.__setitem__({key}, {t})", replaced),
                (f"{c}.insert(0, {t})", [var, *container.items]),
                (f"{c}.append({t})", [*container.items, var]),
            ]
        else:
            options += [
                (f"{c}.update({key[1:-1]}={t})", replaced),
                # A new key, never read back by the grammar: the items stay as they were.
                (f"{c}.setdefault('k9', {t})", list(container.items)),
            ]
        line, items = self.pick(options)
        self.env[c] = ContainerVar(container.kind, tuple(items))
        return [line]

    def s_dunder(self) -> list[str]:
        t, _var = self.tensor_expr()
        return [
            self.pick(
                [
                    f"operator.iadd({t}, 1.0)",
                    f"operator.imul({t}, 2.0)",
                    f"operator.setitem({t}, Ellipsis, 4.0)",
                    f"{t}.__iadd__(1.0)",
                    f"{t}.__setitem__(Ellipsis, 4.0)",
                    f"torch.Tensor.__imul__({t}, 2.0)",
                    f"type({t}).__isub__({t}, 1.0)",
                    f"operator.add({t}, 1.0)",
                ]
            )
        ]

    def s_reflection(self) -> list[str]:
        t, _var = self.tensor_name()
        snapshots = self.names(SnapshotVar)
        options = [
            f'exec("{t}.add_(1.0)")',
            f'locals()["{t}"].mul_(2.0)',
            f'eval("{t}").neg_()',
            f'vars()["{t}"].sub_(1.0)',
        ]
        for s in snapshots:
            snapshot = self.env[s]
            assert isinstance(snapshot, SnapshotVar)
            options += [f'{s}["{n}"].add_(1.0)' for n, _ in snapshot.names]
        if self.draw(st.integers(0, 2)) == 0:
            name = self.fresh_name()
            held = tuple((n, v) for n, v in self.env.items() if isinstance(v, TensorVar))
            self.env[name] = SnapshotVar(held)
            return [f"{name} = locals()"]
        return [self.pick(options)]

    def s_del(self) -> list[str]:
        deletable = [n for n in self.env if n not in SHADOWABLE]
        name = self.pick(deletable)
        if name == "x":
            t, var = self.tensor_expr()
            if not var.projectable or t == "x":
                return []
            self.env["x"] = var
            return ["del x", f"x = {t}"]
        del self.env[name]
        return [f"del {name}"]

    def s_match(self) -> list[str]:
        t, var = self.tensor_expr()
        name = self.target(var)
        body = self.pick(["pass", f"{name}.add_(1.0)"])
        self.env[name] = var
        return [f"match {t}:", f"    case {name}:", f"        {body}"]

    def s_shadow(self) -> list[str]:
        free = [n for n in SHADOWABLE if n not in self.env]
        if not free:
            return []
        name = self.pick(free)
        self.env[name] = CallableVar("inplace1")
        return [f"{name} = lambda v: v.add_(1.0)"]

    def s_set_storage(self) -> list[str]:
        t, var = self.tensor_expr()
        same = [
            n
            for n, v in self.env.items()
            if isinstance(v, TensorVar) and v.shape == var.shape and v.contiguous
        ]
        if not same:
            return []
        u = self.pick(sorted(same, key=_name_order))
        return [self.pick([f"{t}.set_({u})", f"{t}.data = {u}", f"{t}.data = {u} + 1.0"])]

    def s_attribute(self) -> list[str]:
        t, var = self.tensor_expr()
        attr = self.pick([*sorted(self.attrs), f"s{self.counter + 1}"])
        self.counter += 1
        self.attrs[attr] = var
        return [f"self.{attr} = {t}"]

    def s_with(self) -> list[str]:
        t, var = self.tensor_expr()
        name = self.target(var)
        body = self.pick(["pass", f"{name}.mul_(2.0)"])
        self.env[name] = var
        return [f"with contextlib.nullcontext({t}) as {name}:", f"    {body}"]

    def s_star_unpack(self) -> list[str]:
        t, var = self.tensor_expr()
        u, uvar = self.tensor_expr()
        first, rest = self.fresh_name(), self.fresh_name()
        self.env[first] = var
        self.env[rest] = ContainerVar("list", (uvar, uvar))
        return [f"{first}, *{rest} = ({t}, {u}, {u})"]

    def s_nested(self) -> list[str]:
        header = self.pick(
            ["if True:", "for _i in range(1):", "with torch.no_grad():", "if len(x):", "try:"]
        )
        lines = [header, *(f"    {line}" for line in self.statement(depth=1))]
        if header == "try:":
            lines += ["except Exception:", "    pass"]
        return lines


def _name_order(name: str) -> tuple[int, int, str]:
    if name == "x":
        return (0, 0, name)
    if name.startswith("v") and name[1:].isdigit():
        return (1, int(name[1:]), name)
    return (2, 0, name)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
