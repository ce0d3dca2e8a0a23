"""Post-fuse edits for the fuzzer (issue 43): ordinary changes a user makes to a model after
`fusion.fuse`, applied alike to the fused model and to an unfused copy made before fusing.

A fused model must go on computing what the unfused one computes after any such edit: it
reads live what the original read, guards what its proofs relied on, and shows the same
types. Each edit kind is its own tally family (`edit-<kind>`, tests/fuzz/oracle.py), so a run
says fused / refused / failed per kind.

An edit is drawn as an abstract `EditSpec` (kind, site index, choice index) and resolved
against the unfused model (`resolve`): the sites of a kind are found there (the attributes
its original forwards read, its children, its helper functions), so one spec means the same
edit whatever the fusion did. A kind with no site in a module resolves to None (counted
`n/a`). The edit is then applied to each model by qualified name; an edit the unfused
model takes and the fused one refuses (a child or attribute fusion removed) is a failure.

Class-level and global changes (a class `forward`, a class property, `nn.Linear.forward`,
a helper's `__code__`) are shared by both models and applied once, through `Patches`, which
puts everything back when the example ends.
"""

from __future__ import annotations

import ast
import copy
import inspect
import os
import textwrap
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.utils import parametrize, prune

from harness.oracles.lifecycle import Doubled

EDIT_KINDS = (
    "attribute",  # a scalar the original forward reads (`self.eps`, a flag, a limit) rewritten
    "class-forward",  # a child's class `forward` patched
    "instance-forward",  # an instance-level `forward` set on a child
    "helper-method",  # a method the forward calls (`self.helper(...)`), class or instance level
    "linear-forward",  # `nn.Linear.forward` patched (restored after the example)
    "linear-subclass",  # a linear's class swapped for a subclass with its own forward
    "code-swap",  # a module-level helper function's `__code__` swapped
    "shadow-setattr",  # a child shadowed by `object.__setattr__` (instance dict beats _modules)
    "shadow-property",  # a child shadowed by a class property added after fusing
    "quantize-dynamic",  # torch.ao.quantization.quantize_dynamic(model, {nn.Linear})
    "copy-copy",  # copy.copy of a module put in its place, then an attribute of the copy edited
    "shard-bias",  # a bias added to a linear that had none
    "parametrize",  # a weight put under torch.nn.utils.parametrize
    "prune",  # a weight pruned (torch.nn.utils.prune.l1_unstructured)
    "inference-mode",  # built, fused, or both inside torch.inference_mode(); run outside it
    "compiled-weight-move",  # compiled and run, then every weight moved (`p.data = ...`)
)
"""Every post-fuse edit kind, simplest first (Hypothesis shrinks towards the first)."""

COMPILING_KINDS = frozenset({"compiled-weight-move"})
"""Kinds that run `torch.compile` (seconds per example, per call shape and dtype the oracle
tries): drawn by the searching profiles and where `FUZZ_EDIT_KINDS` names them, not by
`fuzz-ci` (its 250 derandomized edits would take minutes more of CI; the `compile`
lifecycle check covers the same hazard on every corpus architecture in CI)."""

KINDS_ENV = "FUZZ_EDIT_KINDS"
"""`FUZZ_EDIT_KINDS=quantize-dynamic,copy-copy` draws only those kinds (to check one fix)."""

STRING_VALUES: dict[str, tuple[str, ...]] = {
    "approximate": ("none", "tanh"),
    "_attn_implementation": ("eager", "sdpa"),
}
"""Values a string attribute may take, by attribute name; other strings are left alone."""

GENERATED_ENTRY_POINTS = frozenset(
    {"build", "make_inputs", "use_experts_implementation"}
    | {"halve_output_hook", "halve_input_pre_hook", "counting_hook"}
)
"""Functions of a generated module that no forward calls: never code-swap sites."""


@dataclass(frozen=True)
class EditSpec:
    """An edit as drawn: its kind, and indices (taken modulo what the module offers) of the
    site and of the value or variant."""

    kind: str
    site: int
    choice: int


@dataclass(frozen=True)
class Edit:
    """A resolved edit: `per_model` is applied to each model (and returns the model to run
    from then on: `quantize_dynamic` or a copy may give another object); `shared` is applied
    once, through `Patches`, for changes both models see (classes, globals)."""

    kind: str
    description: str
    per_model: Callable[[nn.Module], nn.Module] | None = None
    shared: Callable[[Patches], None] | None = None
    build_in_inference_mode: bool = False
    fuse_in_inference_mode: bool = False


@dataclass
class Patches:
    """Attribute changes on shared objects (classes, functions, modules), undone by
    `restore` in reverse order: an attribute absent before is deleted again."""

    undo: list[tuple[Any, str, Any]] = field(default_factory=list)

    def set(self, owner: Any, name: str, value: Any) -> None:
        before = owner.__dict__.get(name, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT
        if name in ("__code__", "__defaults__", "__kwdefaults__"):
            before = getattr(owner, name)
        self.undo.append((owner, name, before))
        setattr(owner, name, value)

    def restore(self) -> None:
        while self.undo:
            owner, name, before = self.undo.pop()
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


_ABSENT = object()


@contextmanager
def patches() -> Iterator[Patches]:
    """A `Patches` whose changes are undone when the block ends, however it ends."""
    held = Patches()
    try:
        yield held
    finally:
        held.restore()


def halve(value: Any) -> Any:
    """`value` with its first floating tensor halved (a tensor, or the first one in a tuple
    or list): a visible, shape-keeping change of a forward's result."""
    if isinstance(value, torch.Tensor):
        return value * 0.5 if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        items = list(value)
        for index, item in enumerate(items):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                items[index] = item * 0.5
                return type(value)(items) if isinstance(value, list) else tuple(items)
    return value


class Halving:
    """A callable that runs `inner` and halves its result: an instance-level patch of a
    method (`module.forward = Halving(module.forward)`). `copy.deepcopy` maps a bound
    `inner` onto the copied module (`copy` deep-copies a method's `__self__`)."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return halve(self.inner(*args, **kwargs))


class Scale(nn.Module):
    """A parametrization: the weight times 1.5."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 1.5


# -- strategy -------------------------------------------------------------------------------------


def edit_kinds() -> tuple[str, ...]:
    """The kinds drawn: all of EDIT_KINDS, or those `FUZZ_EDIT_KINDS` names."""
    chosen = os.environ.get(KINDS_ENV, "")
    if not chosen:
        if os.environ.get("FUZZ_PROFILE", "fuzz-ci") == "fuzz-ci":
            return tuple(k for k in EDIT_KINDS if k not in COMPILING_KINDS)
        return EDIT_KINDS
    kinds = tuple(k.strip() for k in chosen.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(EDIT_KINDS))
    if unknown:
        raise ValueError(f"{KINDS_ENV}: unknown edit kinds {unknown}; expected {EDIT_KINDS}")
    return kinds


def edit_specs() -> st.SearchStrategy[EditSpec]:
    """One post-fuse edit: a kind, a site index and a choice index."""
    return st.builds(
        EditSpec,
        kind=st.sampled_from(edit_kinds()),
        site=st.integers(0, 63),
        choice=st.integers(0, 7),
    )


# -- sites ----------------------------------------------------------------------------------------


def self_reads(cls: type) -> tuple[str, ...]:
    """Names `n` of every `self.n` the class's `forward` source loads, in order of first
    appearance; () where there is no readable source (a C or generated forward)."""
    forward = getattr(cls, "forward", None)
    if forward is None or forward is nn.Module.forward:
        return ()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return ()
    function = tree.body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or not function.args.args:
        return ()
    this = function.args.args[0].arg
    loads = sorted(
        (
            node
            for node in ast.walk(function)
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name)
            and node.value.id == this
        ),
        key=lambda node: (node.lineno, node.col_offset),
    )
    names = dict.fromkeys(node.attr for node in loads)
    return tuple(names)


def alternatives(name: str, value: Any) -> list[Any]:
    """Other values for a scalar attribute: a flipped bool, nearby ints, scaled floats,
    the known alternatives of a string; [] for anything else."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return sorted({value + 1, max(value - 1, 0), 1, 2} - {value})
    if isinstance(value, float):
        return [
            v
            for v in dict.fromkeys((value * 2, value * 0.5, value + 0.25, value * 10))
            if v != value
        ]
    if isinstance(value, str):
        return [v for v in STRING_VALUES.get(name, ()) if v != value]
    return []


def attribute_sites(model: nn.Module) -> list[tuple[str, str, list[Any]]]:
    """(qualified name, attribute, other values) for every scalar attribute (int, float,
    bool, str) a module's original forward reads as `self.<attribute>`."""
    sites = []
    for qualname, module in model.named_modules():
        for name in self_reads(type(module)):
            if name in module._modules or name in module._parameters or name in module._buffers:
                continue
            if name == "p" and isinstance(module, _DropoutNd):
                continue  # a nonzero rate makes both forwards random: nothing to compare
            value = getattr(module, name, None)
            if isinstance(value, (int, float, bool, str)):
                values = alternatives(name, value)
                if values:
                    sites.append((qualname, name, values))
    return sites


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def child_sites(model: nn.Module) -> list[tuple[str, str]]:
    """(parent's qualified name, child name) for every child reached by attribute (not a
    container's index)."""
    return [
        (qualname, name)
        for qualname, module in model.named_modules()
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential))
        for name, child in module._modules.items()
        if child is not None
    ]


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _parent(model: nn.Module, qualname: str) -> tuple[nn.Module, str]:
    parent, _, name = qualname.rpartition(".")
    return model.get_submodule(parent), name


# -- edits ----------------------------------------------------------------------------------------


def _attribute(sites: list[tuple[str, str, list[Any]]], spec: EditSpec) -> Edit | None:
    if not sites:
        return None
    qualname, name, values = sites[spec.site % len(sites)]
    value = values[spec.choice % len(values)]

    def write(model: nn.Module) -> nn.Module:
        setattr(model.get_submodule(qualname), name, value)
        return model

    return Edit("attribute", f"{_join(qualname, name)} = {value!r}", per_model=write)


def _class_forward(model: nn.Module, spec: EditSpec) -> Edit | None:
    classes = list(
        dict.fromkeys(
            type(m)
            for q, m in model.named_modules()
            if q and _has_forward(m) and type(m) is not nn.Linear
        )
    )
    if not classes:
        return None
    cls = classes[spec.site % len(classes)]

    def patch(held: Patches) -> None:
        original = cls.forward

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return halve(original(self, *args, **kwargs))

        held.set(cls, "forward", forward)

    return Edit("class-forward", f"{cls.__qualname__}.forward halved", shared=patch)


def _instance_forward(model: nn.Module, spec: EditSpec) -> Edit | None:
    names = [q for q, m in model.named_modules() if q and _has_forward(m)]
    if not names:
        return None
    qualname = names[spec.site % len(names)]

    def patch(model: nn.Module) -> nn.Module:
        module = model.get_submodule(qualname)
        module.forward = Halving(module.forward)
        return model

    return Edit("instance-forward", f"{qualname}.forward = Halving(...)", per_model=patch)


def helper_sites(model: nn.Module) -> list[tuple[str, str, bool]]:
    """(qualified name, name, a class method) for every callable that is not a child a
    module's original forward reads as `self.<name>`: a method of its class (patchable on the
    class or the instance) or a function stored on the instance (an activation's `act`)."""
    sites = []
    for qualname, module in model.named_modules():
        for name in self_reads(type(module)):
            if name == "forward" or name in module._modules:
                continue
            if name in module.__dict__:
                value = module.__dict__[name]
                if callable(value) and not isinstance(value, (nn.Module, torch.Tensor, type)):
                    sites.append((qualname, name, False))
            elif inspect.isfunction(inspect.getattr_static(type(module), name, None)):
                sites.append((qualname, name, True))
    return sites


def _global_module_forward(module: nn.Module, name: str, on_class: bool) -> Edit:
    """A module object called as a global: its class's `forward` halved (`on_class`), or an
    instance-level `forward` that halves set on it. Shared: both models call the one object."""
    cls = type(module)

    def patch(held: Patches) -> None:
        if on_class:
            original = cls.forward

            def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
                return halve(original(self, *args, **kwargs))

            held.set(cls, "forward", forward)
        else:
            held.set(module, "forward", Halving(module.forward))

    where = f"{cls.__qualname__}.forward" if on_class else f"{name}.forward"
    return Edit("code-swap", f"{where} halved (a module called as a global)", shared=patch)


def _helper_method(model: nn.Module, spec: EditSpec) -> Edit | None:
    sites = helper_sites(model)
    if not sites:
        return None
    qualname, name, on_class = sites[spec.site % len(sites)]
    if on_class and spec.choice % 2 == 0:
        cls = type(model.get_submodule(qualname))

        def patch_class(held: Patches) -> None:
            original = getattr(cls, name)

            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                return halve(original(self, *args, **kwargs))

            held.set(cls, name, method)

        return Edit("helper-method", f"{cls.__qualname__}.{name} halved", shared=patch_class)

    def patch_instance(model: nn.Module) -> nn.Module:
        module = model.get_submodule(qualname)
        object.__setattr__(module, name, Halving(getattr(module, name)))
        return model

    return Edit(
        "helper-method", f"{_join(qualname, name)} = Halving(...)", per_model=patch_instance
    )


def _linear_forward(model: nn.Module, spec: EditSpec) -> Edit | None:
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        return None

    def patch(held: Patches) -> None:
        original = nn.Linear.forward

        def forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
            return original(self, input) * 0.5

        held.set(nn.Linear, "forward", forward)

    return Edit("linear-forward", "nn.Linear.forward halved", shared=patch)


def halved_subclass(cls: type[nn.Linear]) -> type[nn.Linear]:
    """A subclass of `cls` whose forward is `cls`'s, halved: a user's own Linear class."""

    def forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
        return cls.forward(self, input) * 0.5

    return type(f"Halved{cls.__name__}", (cls,), {"forward": forward})


def _linear_subclass(model: nn.Module, spec: EditSpec) -> Edit | None:
    names = [q for q, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        return None
    qualname = names[spec.site % len(names)]
    made: dict[type, type] = {}

    def swap(model: nn.Module) -> nn.Module:
        module = model.get_submodule(qualname)
        cls = type(module)
        module.__class__ = made.setdefault(cls, halved_subclass(cls))
        return model

    return Edit("linear-subclass", f"{qualname}.__class__ = Halved<its class>", per_model=swap)


def _code_swap(generated: types.ModuleType, spec: EditSpec) -> Edit | None:
    """A module-level helper's `__code__` swapped, or, for a module object called as a
    global (`apply_rotary_kernel`, as Transformers 5.25's kernels hub makes
    `apply_rotary_pos_emb`), its class's or its instance's `forward` replaced."""
    names = sorted(
        name
        for name, value in vars(generated).items()
        if (inspect.isfunction(value) and value.__module__ == generated.__name__)
        or (isinstance(value, nn.Module) and type(value).__module__ == generated.__name__)
        if name not in GENERATED_ENTRY_POINTS
    )
    if not names:
        return None
    name = names[spec.site % len(names)]
    if isinstance(vars(generated)[name], nn.Module):
        return _global_module_forward(vars(generated)[name], name, spec.choice % 2 == 0)
    writes = spec.choice % 2 == 1
    function = vars(generated)[name]

    def swap(held: Patches) -> None:
        kept = types.FunctionType(
            function.__code__, function.__globals__, name, function.__defaults__
        )
        kept.__kwdefaults__ = function.__kwdefaults__
        held.set(generated, f"_fuzz_original_{name}", kept)
        held.set(generated, "_fuzz_halve", halve)
        if writes:  # the helper now writes its first tensor argument: no longer pure
            body = (
                f"    result = _fuzz_original_{name}(*args, **kwargs)\n"
                "    for arg in args:\n"
                "        if isinstance(arg, _fuzz_torch.Tensor) and arg.is_floating_point():\n"
                "            arg.mul_(0.5)\n"
                "            break\n"
                "    return result\n"
            )
            held.set(generated, "_fuzz_torch", torch)
        else:
            body = f"    return _fuzz_halve(_fuzz_original_{name}(*args, **kwargs))\n"
        namespace: dict[str, Any] = {}
        exec(compile(f"def {name}(*args, **kwargs):\n{body}", "<code swap>", "exec"), namespace)
        held.set(function, "__defaults__", None)
        held.set(function, "__kwdefaults__", None)
        held.set(function, "__code__", namespace[name].__code__)

    effect = "writes its first tensor argument" if writes else "halves its result"
    return Edit("code-swap", f"{name}.__code__ swapped (now {effect})", shared=swap)


def _shadow_setattr(model: nn.Module, spec: EditSpec) -> Edit | None:
    sites = child_sites(model)
    if not sites:
        return None
    parent_name, name = sites[spec.site % len(sites)]

    def shadow(model: nn.Module) -> nn.Module:
        parent = model.get_submodule(parent_name)
        object.__setattr__(parent, name, Doubled(parent._modules[name]))
        return model

    where = _join(parent_name, name)
    return Edit(
        "shadow-setattr", f"object.__setattr__: {where} shadowed by Doubled", per_model=shadow
    )


def _shadow_property(model: nn.Module, generated: types.ModuleType, spec: EditSpec) -> Edit | None:
    sites = [
        (parent, name)
        for parent, name in child_sites(model)
        if type(model.get_submodule(parent)).__module__ == generated.__name__
    ]
    if not sites:
        return None
    parent_name, name = sites[spec.site % len(sites)]
    cls = type(model.get_submodule(parent_name))

    def shadow(held: Patches) -> None:
        held.set(cls, name, property(lambda self: Doubled(self._modules[name])))

    return Edit(
        "shadow-property", f"{cls.__qualname__}.{name} = property(Doubled child)", shared=shadow
    )


def _quantize_dynamic(model: nn.Module, spec: EditSpec) -> Edit | None:
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        return None

    def quantize(model: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated
            return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, inplace=True)

    return Edit("quantize-dynamic", "quantize_dynamic(model, {nn.Linear})", per_model=quantize)


def _copy_copy(sites: list[tuple[str, str, list[Any]]], spec: EditSpec) -> Edit | None:
    sites = [site for site in sites if site[0]]
    if not sites:
        return None
    qualname, name, values = sites[spec.site % len(sites)]
    value = values[spec.choice % len(values)]

    def copy_and_write(model: nn.Module) -> nn.Module:
        parent, leaf = _parent(model, qualname)
        shallow = copy.copy(model.get_submodule(qualname))
        setattr(parent, leaf, shallow)
        setattr(shallow, name, value)
        return model

    return Edit(
        "copy-copy",
        f"{qualname} = copy.copy({qualname}); then .{name} = {value!r} on the copy",
        per_model=copy_and_write,
    )


def _shard_bias(model: nn.Module, spec: EditSpec) -> Edit | None:
    names = [q for q, m in model.named_modules() if isinstance(m, nn.Linear) and m.bias is None]
    if not names:
        return None
    qualname = names[spec.site % len(names)]

    def add_bias(model: nn.Module) -> nn.Module:
        module = model.get_submodule(qualname)
        generator = torch.Generator().manual_seed(spec.choice)
        bias = torch.randn(module.weight.shape[0], generator=generator) * 0.5
        module.bias = nn.Parameter(bias.to(module.weight.dtype))
        return model

    return Edit("shard-bias", f"{qualname}.bias added (it had none)", per_model=add_bias)


def _weight_sites(model: nn.Module) -> list[str]:
    return [
        q for q, m in model.named_modules() if isinstance(m._parameters.get("weight"), nn.Parameter)
    ]


def _parametrize(model: nn.Module, spec: EditSpec) -> Edit | None:
    names = _weight_sites(model)
    if not names:
        return None
    qualname = names[spec.site % len(names)]

    def register(model: nn.Module) -> nn.Module:
        parametrize.register_parametrization(model.get_submodule(qualname), "weight", Scale())
        return model

    return Edit("parametrize", f"{qualname}.weight parametrized (x1.5)", per_model=register)


def _prune(model: nn.Module, spec: EditSpec) -> Edit | None:
    names = _weight_sites(model)
    if not names:
        return None
    qualname = names[spec.site % len(names)]

    def prune_weight(model: nn.Module) -> nn.Module:
        # Under no_grad the pruned `weight` is a leaf until the next forward, so the
        # oracle's deep copies taken before it work.
        with torch.no_grad():
            prune.l1_unstructured(model.get_submodule(qualname), "weight", amount=0.3)
        return model

    return Edit("prune", f"{qualname}.weight pruned (l1, 30%)", per_model=prune_weight)


class CompiledThenMoved(nn.Module):
    """`model` under `torch.compile` (Dynamo, eager backend): its first call runs the compiled
    code once, then moves every floating weight to memory of its own (`p.data = p.data *
    0.75`: a merged projection's views of its stacked weight are broken) and runs it again;
    every later call runs the compiled code. Dynamo guards neither `.data` nor an address, so
    compiled code that kept reading memory the move left behind (a stacked weight) computes
    stale values. The unfused twin is wrapped alike, so parameter names match."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.moved = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        compiled = torch.compile(self.model, backend="eager")
        if not self.moved:
            # each example's models are new code for Dynamo, and its per-code cache limit
            # is shared with every example before (fused forwards share their code)
            torch._dynamo.reset()
            with torch.no_grad():
                compiled(*args, **kwargs)
            for param in self.model.parameters():
                if param.is_floating_point():
                    param.data = param.data * 0.75
            self.moved = True
        return compiled(*args, **kwargs)


def _compiled_weight_move(model: nn.Module, spec: EditSpec) -> Edit | None:
    if not any(p.is_floating_point() for p in model.parameters()):
        return None
    return Edit(
        "compiled-weight-move",
        "torch.compile'd and run, then every weight moved (p.data = p.data * 0.75)",
        per_model=CompiledThenMoved,
    )


def resolve(spec: EditSpec, model: nn.Module, generated: types.ModuleType) -> Edit | None:
    """The edit `spec` means for the unfused `model` (built from the imported `generated`
    module), or None when the module offers its kind no site."""
    kind = spec.kind
    if kind == "attribute":
        return _attribute(attribute_sites(model), spec)
    if kind == "class-forward":
        return _class_forward(model, spec)
    if kind == "instance-forward":
        return _instance_forward(model, spec)
    if kind == "helper-method":
        return _helper_method(model, spec)
    if kind == "linear-forward":
        return _linear_forward(model, spec)
    if kind == "linear-subclass":
        return _linear_subclass(model, spec)
    if kind == "code-swap":
        return _code_swap(generated, spec)
    if kind == "shadow-setattr":
        return _shadow_setattr(model, spec)
    if kind == "shadow-property":
        return _shadow_property(model, generated, spec)
    if kind == "quantize-dynamic":
        return _quantize_dynamic(model, spec)
    if kind == "copy-copy":
        return _copy_copy(attribute_sites(model), spec)
    if kind == "shard-bias":
        return _shard_bias(model, spec)
    if kind == "parametrize":
        return _parametrize(model, spec)
    if kind == "prune":
        return _prune(model, spec)
    if kind == "compiled-weight-move":
        return _compiled_weight_move(model, spec)
    if kind == "inference-mode":
        variant = spec.choice % 3
        build_inside, fuse_inside = variant in (0, 1), variant in (1, 2)
        where = " and ".join(
            step for step, inside in (("built", build_inside), ("fused", fuse_inside)) if inside
        )
        return Edit(
            "inference-mode",
            f"{where} inside torch.inference_mode()",
            build_in_inference_mode=build_inside,
            fuse_in_inference_mode=fuse_inside,
        )
    raise ValueError(f"unknown edit kind {kind!r}; expected one of {EDIT_KINDS}")
