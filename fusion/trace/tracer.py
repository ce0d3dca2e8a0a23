"""Trace one module's own forward with torch.fx, tolerating what fx cannot follow.

`trace(module)` returns the fx graph of `module.forward` with every submodule kept as one
`call_module` leaf, so matching sees the module's own structure (an activation stays
`act_fn(...)`, not `sigmoid(x) * x`). It never raises: an untraceable op ends the trace and
the graph recorded so far is returned, because the fusers only need the dataflow between
projections, which is usually complete long before the forward ends.

Shape questions (`len`, iteration, `.shape` unpacking, `*`-splats) are answered by running
every recorded op again on meta tensors. PyTorch's meta kernels are therefore the only shape
rules: there is no per-op table to fall out of date.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import linecache
import logging
import operator
import tokenize
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any
from unittest import mock

import torch
from torch import fx, nn

from fusion.errors import RewriteRefused
from fusion.trace.wrappers import kernel_function, unwrap_forward

logger = logging.getLogger(__name__)


def _call_without_hooks(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`nn.Module.__call__` minus hooks: meta execution must run children for real, without
    being recorded by fx (which patches `__call__`) and without firing user hooks, which
    may have side effects and would run on meta tensors."""
    return self.forward(*args, **kwargs)


UNKNOWN: Any = object()
"""Meta value of a proxy whose value could not be inferred (distinct from a concrete None)."""

CACHE_ARGUMENTS = ("past_key_values", "cache", "layer_past")
"""Spellings of the KV-cache argument: Transformers 5.24 renamed `past_key_values` to
`cache`; a few attention classes (GPTBigCode, GPT-J-style) still call it `layer_past`."""

META_VALUE = "fusion_meta"
"""`node.meta` key holding the node's value computed on meta tensors, when it is known."""

LEAF_CALL = "leaf_call"
"""`node.meta` key marking an opaque call recorded by `leaf_call` (e.g. attention)."""


def reference_weight(module: nn.Module) -> torch.Tensor | None:
    """A weight whose trailing dimension is the width `module` reads.

    The first linear's weight is `[out, in]` with `in` the input width; failing that, a 1-D
    or 2-D parameter (a norm's `[hidden]`, a router's `[experts, hidden]`). None when the
    module holds no such weight (a weightless norm): its input then stays unknown.
    """
    for child in module.modules():
        if isinstance(child, nn.Linear):
            return child.weight
    for param in module.parameters():
        if param.ndim in (1, 2):
            return param
    return None


def forward_parameters(module: nn.Module) -> dict[str, inspect.Parameter]:
    """The parameters of `type(module).forward` under its proven decorators
    (`fusion.trace.wrappers.unwrap_forward`), or {} when a decorator is not proven or there is no
    signature."""
    try:
        return dict(inspect.signature(unwrap_forward(type(module).forward)).parameters)
    except (TypeError, ValueError, RewriteRefused):
        return {}


class _MetaProxy(fx.Proxy):
    """A proxy that also carries the value of its expression on meta tensors."""

    meta: Any = UNKNOWN

    def __len__(self) -> int:
        if self.meta is not UNKNOWN:
            return len(self.meta)
        return super().__len__()  # type: ignore[misc]

    def __getattr__(self, name: str) -> _MetaAttribute:
        return _MetaAttribute(self, name)

    def __setitem__(self, key: object, value: object) -> None:
        # `obj[k] = v` (a container write such as a shared KV dict) is recorded as a node,
        # so the trace goes on and the alias analysis can still see the write in source.
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class _MetaAttribute(_MetaProxy, fx.proxy.Attribute):
    """`x.attr` as a proxy; fx builds these directly, so the meta value is grafted on here."""

    def __init__(self, root: fx.Proxy, attr: str) -> None:
        super().__init__(root, attr)
        root_meta = getattr(root, "meta", UNKNOWN)
        if root_meta is not UNKNOWN:
            with contextlib.suppress(Exception):
                self.meta = getattr(root_meta, attr)


def _meta_state(child: nn.Module) -> dict[str, torch.Tensor]:
    """Meta copies of `child`'s parameters and buffers, leaving `child` itself untouched."""
    return {
        name: torch.empty_like(tensor, device="meta")
        for name, tensor in chain(child.named_parameters(), child.named_buffers())
    }


def _resolve_attr(root: nn.Module, target: str) -> Any:
    """`root.<target>` read from the module dicts directly.

    While fx traces, `nn.Module.__getattr__` is patched to emit `get_attr` nodes; reading a
    parameter through it from inside meta execution would record (and recurse) again.
    """
    *path, leaf = target.split(".")
    module = root
    for part in path:
        module = module._modules[part]
    for table in ("_parameters", "_buffers", "_modules"):
        entries = module.__dict__.get(table, {})
        if leaf in entries:
            return entries[leaf]
    return object.__getattribute__(module, leaf)


MAX_BRANCH_DECISIONS = 64
"""Most branches a deciding trace (`trace(..., decide_branches=True)`) takes before it ends:
a `while` on a value it cannot know would otherwise never stop."""


class LeafTracer(fx.Tracer):
    """An fx tracer for which every submodule is a leaf and every op also runs on meta.

    With `decide_branches`, a branch on a traced value (`if x.size(1) == 1`, `assert
    list(x.size()) == [...]`) follows its meta value where that is a Python bool, a flag
    argument's default (`if output_attentions:`), and otherwise the true side, instead of
    ending the trace (`to_bool`)."""

    def __init__(
        self,
        varkw: str | None = None,
        input_name: str | None = None,
        *,
        decide_branches: bool = False,
    ) -> None:
        super().__init__()
        self.varkw = varkw
        self.input_name = input_name
        self.decide_branches = decide_branches
        self.decisions = 0

    def to_bool(self, obj: fx.Proxy) -> bool:
        """The branch a deciding trace takes (see the class docstring); without
        `decide_branches`, fx's refusal (the trace ends there)."""
        if not self.decide_branches:
            return super().to_bool(obj)
        self.decisions += 1
        if self.decisions > MAX_BRANCH_DECISIONS:
            raise fx.proxy.TraceError(f"more than {MAX_BRANCH_DECISIONS} branches decided")
        value = getattr(obj, "meta", UNKNOWN)
        if isinstance(value, (bool, int)):  # a shape comparison on meta: plain Python
            return bool(value)
        node = obj.node
        if node.op == "placeholder" and node.args:  # a flag argument: its default
            return bool(node.args[0])
        return True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _MetaProxy(node, self)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        # Trace the undecorated forward: wrappers such as Transformers' `deprecate_kwarg`
        # take `(*args, **kwargs)`, which fx cannot map back to the real parameters. Only
        # wrappers proven to pass the call through are seen through (RewriteRefused else).
        return super().create_args_for_root(unwrap_forward(root_fn), is_module, concrete_args)

    def call_module(self, m, forward, args, kwargs):
        # A module object that is not a submodule, called from the forward (Transformers
        # 5.25's kernels function layers, e.g. `apply_rotary_pos_emb`): fx could give it no
        # name. Its computation is traced through when it is proven to be a plain function
        # (`fusion.trace.wrappers.kernel_function`); otherwise RewriteRefused ends the trace.
        if not any(m is child for child in self.root.modules()):
            return kernel_function(m, self.root)(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def create_proxy(self, kind, target, args, kwargs, *rest, **rest_kwargs):
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **rest_kwargs)
        if isinstance(proxy, _MetaProxy) and proxy.meta is UNKNOWN:
            # An op whose meta value fails stays unknown; only a shape question about it
            # later ends the trace.
            with contextlib.suppress(Exception):
                proxy.meta = self._run_on_meta(kind, target, args, kwargs)
        if isinstance(proxy, _MetaProxy) and proxy.meta is not UNKNOWN:
            # Kept on the node too, so analyses after tracing can re-run ops on meta values.
            proxy.node.meta[META_VALUE] = proxy.meta
        return proxy

    def _run_on_meta(self, kind: str, target: object, args: tuple, kwargs: dict) -> Any:
        if kind == "placeholder":
            return self._placeholder_meta(str(target))
        if kind == "get_attr":
            value = _resolve_attr(self.root, str(target))
            return torch.empty_like(value, device="meta") if torch.is_tensor(value) else value
        unknown = False

        def to_meta(arg: object) -> object:
            nonlocal unknown
            if isinstance(arg, fx.Proxy):
                value = getattr(arg, "meta", UNKNOWN)
                unknown = unknown or value is UNKNOWN
                return value
            return arg

        meta_args = fx.node.map_aggregate(args, to_meta)
        meta_kwargs = fx.node.map_aggregate(kwargs, to_meta)
        if unknown:
            return UNKNOWN
        if kind == "call_function":
            return target(*meta_args, **meta_kwargs)  # type: ignore[operator]
        if kind == "call_method":
            receiver, *rest = meta_args
            return getattr(receiver, str(target))(*rest, **meta_kwargs)
        if kind == "call_module":
            child = self.root.get_submodule(str(target))
            # fx patches `nn.Module.__call__` while tracing; the child must run for real
            # (on meta state) without being recorded itself.
            with mock.patch.object(nn.Module, "__call__", _call_without_hooks):
                return torch.func.functional_call(child, _meta_state(child), meta_args, meta_kwargs)
        return UNKNOWN

    def _placeholder_meta(self, name: str) -> Any:
        # Serving engines feed [tokens..., hidden] activations; a [1, 8, hidden] stand-in in
        # the dtype of a reference weight answers every shape question a forward asks.
        if name != self.input_name:
            return UNKNOWN
        weight = reference_weight(self.root)
        if weight is None:
            return UNKNOWN
        return torch.empty(1, 8, weight.shape[-1], dtype=weight.dtype, device="meta")

    def _is_varkw(self, node: object) -> bool:
        return (
            isinstance(node, fx.Node)
            and node.op == "placeholder"
            and str(node.target).lstrip("*") == self.varkw
        )

    def iter(self, obj: fx.Proxy) -> Iterator:
        node = obj.node
        # `**kwargs` (and its `.keys()`, `.values()`, `.items()`) iterate as empty: the fusers
        # only care about the tensors a forward computes, and keyword extras pass through.
        if self._is_varkw(node) or (
            node.op == "call_method"
            and node.target in ("keys", "values", "items")
            and self._is_varkw(node.args[0])
        ):
            return iter(())
        value = getattr(obj, "meta", UNKNOWN)
        if value is UNKNOWN:
            return super().iter(obj)
        return iter([obj[i] for i in range(len(value))])


def leaf_call(fn: Callable, outputs: int | None = None) -> Callable:
    """Wrap `fn` so that, while tracing, it is recorded as one opaque `call_function` node.

    Only proxy arguments become the node's inputs. `outputs` declares how many values `fn`
    returns so that unpacking the result traces too. Outside tracing (no proxy argument) the
    wrapper simply calls `fn`, so patching it in is harmless to real execution. Wrapping a
    wrapper wraps the original function, so the node's target is always the real callee.
    """
    fn = getattr(fn, "__wrapped_leaf__", fn)

    def leaf(*args: Any, **kwargs: Any) -> Any:
        proxies = tuple(arg for arg in args if isinstance(arg, fx.Proxy))
        if not proxies:
            return fn(*args, **kwargs)
        proxy = proxies[0].tracer.create_proxy("call_function", fn, proxies, {})
        proxy.node.meta[LEAF_CALL] = True
        if outputs is not None:
            proxy.meta = (UNKNOWN,) * outputs
        return proxy

    leaf.__wrapped_leaf__ = fn  # type: ignore[attr-defined]
    return leaf


def _attention_patches(forward_globals: dict[str, Any]) -> list[Any]:
    """Patches that turn every attention-interface lookup into a two-output leaf call.

    Transformers 5 resolves attention through `AttentionInterface.get_interface`; 4.x indexes
    `ALL_ATTENTION_FUNCTIONS[...]`, and both fall back to a module-level
    `eager_attention_forward`, patched here in the forward's own globals. Every attention
    function returns `(attn_output, attn_weights)`.
    """
    patches: list[Any] = []
    try:
        from transformers.modeling_utils import AttentionInterface
    except Exception:  # transformers missing or too old: nothing to patch
        AttentionInterface = None
    if AttentionInterface is not None:
        for method in ("get_interface", "__getitem__", "get"):
            original = getattr(AttentionInterface, method, None)
            if original is None:
                continue

            def wrapped(self, *args, _original=original, **kwargs):
                return leaf_call(_original(self, *args, **kwargs), outputs=2)

            patches.append(mock.patch.object(AttentionInterface, method, wrapped))
    for name, value in forward_globals.items():
        if name.endswith("attention_forward") and inspect.isfunction(value):
            patches.append(mock.patch.dict(forward_globals, {name: leaf_call(value, outputs=2)}))
    return patches


@contextlib.contextmanager
def _preserved_state(module: nn.Module) -> Iterator[None]:
    """Put back every attribute of `module` and its descendants on exit.

    A forward may store what it computes (`self.last = x`, `self.register_buffer(...)`,
    `self.history.append(x)`); while tracing that would leave proxies on the module, and
    while a child runs on meta tensors, meta tensors. Tracing must leave the module exactly
    as it found it, so each `__dict__` and the containers in it are restored in place.
    """
    saved = []
    for child in module.modules():
        state = dict(child.__dict__)
        contents = {
            name: copy.copy(value)
            for name, value in state.items()
            if isinstance(value, (dict, list, set))
        }
        saved.append((child, state, contents))
    try:
        yield
    finally:
        for child, state, contents in saved:
            for name, content in contents.items():
                live = state[name]
                if isinstance(live, list):
                    live[:] = content
                else:
                    live.clear()
                    live.update(content)
            current = child.__dict__
            for name in [name for name in current if name not in state]:
                del current[name]
            current.update(state)


AUTOCAST_DEVICES = ("cpu", "cuda")
"""Device types whose autocast state a trace puts back (`preserved_globals`)."""


FP32_PRECISION_KEYS = (
    ("generic", "all"),
    ("mkldnn", "all"),
    ("cuda", "all"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
)
"""Every float32 precision setting (backend, op), parents first: writing a parent resets
its children, so they are written back in this order."""


def _fp32_precisions() -> list[str]:
    """The float32 precision settings (`FP32_PRECISION_KEYS`), read at the level ATen keeps
    them: never refused, unlike `torch.get_float32_matmul_precision()` after the legacy and
    per-backend APIs were mixed, and exact (`set_float32_matmul_precision("highest")` writes
    'ieee' where the default is 'none', which later parent settings no longer override)."""
    return [torch._C._get_fp32_precision_getter(b, op) for b, op in FP32_PRECISION_KEYS]


@contextlib.contextmanager
def preserved_globals() -> Iterator[None]:
    """Put back the global state a forward's Python code can change on exit: grad mode,
    autocast (enabled and dtype per device), the default dtype, the float32 matmul
    precision, deterministic-algorithms mode and the CPU random generator.

    Tracing runs a forward's non-tensor code, and a forward can stop half-way (an op fx
    cannot follow, a branch on a traced value): a `torch.set_grad_enabled(False)` or
    `torch.set_autocast_enabled("cpu", True)` that ran without its counterpart would outlive
    `fusion.plan` and silently change every later computation of the caller's. Each setting
    is written back only where it changed; the precision settings exactly as they were
    (`_fp32_precisions`), whichever API set them."""
    grad = torch.is_grad_enabled()
    autocast = [
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in AUTOCAST_DEVICES
    ]
    default_dtype = torch.get_default_dtype()
    precision = _fp32_precisions()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_grad_enabled(grad)
        for device, enabled, dtype in autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_default_dtype(default_dtype)
        if _fp32_precisions() != precision:
            for (backend, op), value in zip(FP32_PRECISION_KEYS, precision):
                torch._C._set_fp32_precision_setter(backend, op, value)
        if (deterministic, warn_only) != (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ):
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_rng_state(rng)


@dataclass(frozen=True)
class Traced:
    """What `traced` recorded: the graph (complete, partial, or None) and, when the trace
    ended before the forward's return, why and where (None when it reached the output)."""

    graph: fx.Graph | None
    stopped: str | None


def _without_comment(line: str) -> str:
    """`line` stripped of its comment and surrounding white space (the line as written
    when it does not tokenize alone, e.g. the first line of a bracketed call)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, SyntaxError):
        return line.strip()
    comment = next((t for t in tokens if t.type == tokenize.COMMENT), None)
    return (line[: comment.start[1]] if comment else line).strip()


def _stop_reason(exc: BaseException, forward: Callable[..., Any], cls: type) -> str:
    """ "the trace stops at `<source line>` in <Class>.forward: <what>": the forward's own
    line the exception left (the innermost frame running its code), or "in <Class>.forward"
    when it never ran (a refused decorator)."""
    what = str(exc) if isinstance(exc, RewriteRefused) else f"{type(exc).__name__}: {exc}"
    code = getattr(forward, "__code__", None)
    # fx may trace a copy of the forward's code (with `*args`/`**kwargs` patched), so its
    # frames are known by where the code was written, not by identity.
    written = None if code is None else (code.co_filename, code.co_firstlineno, code.co_name)
    line = None
    tb: types.TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame.f_code
        if (frame.co_filename, frame.co_firstlineno, frame.co_name) == written:
            line = _without_comment(linecache.getline(frame.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    where = f"`{line}` in " if line else "the start of "
    return f"the trace stops at {where}{cls.__name__}.forward: {what}"


def trace(
    module: nn.Module, *, decide_branches: bool = False, none_defaults: bool = False
) -> fx.Graph | None:
    """The fx graph of `module.forward`: complete, partial, or None if nothing was recorded
    (`traced(...).graph`; see there)."""
    return traced(module, decide_branches=decide_branches, none_defaults=none_defaults).graph


def traced(
    module: nn.Module, *, decide_branches: bool = False, none_defaults: bool = False
) -> Traced:
    """The fx graph of `module.forward` (complete, partial, or None if nothing was recorded)
    and, if the trace ended early, the reason (`Traced.stopped`).

    Never raises, and leaves `module` and the global torch state (`preserved_globals`) as
    it was. The forward traced is the class's function under its decorators, each proven to
    pass the call through (`fusion.trace.wrappers.unwrap_forward`); any other decorator ends the
    trace before it starts (graph None, the decorator named). The KV-cache argument (any
    spelling in `CACHE_ARGUMENTS`) is made a concrete `None`, as serving engines never pass
    it to the module; `**kwargs` iterate as empty; attention interfaces are opaque leaves.
    On any failure the reason is logged at debug level and the partial graph is returned:
    matching on it is safe because every fuser still checks the source it rewrites, and
    refuses what the graph does not show.

    With `decide_branches` the trace goes on through branches on traced values, taking one
    side (`LeafTracer.to_bool`): the graph is then one path of several, valid only for a
    fuser whose rewrite is proven on the source for every path (the projection stackers),
    never for one that reads the function off the graph (RMSNorm, MoE routing). With
    `none_defaults` every argument after the input that defaults to None is a concrete None
    too (`if conv_mask is not None:` then skips the branch a caller that passes nothing
    skips), for the same fusers only.
    """
    try:
        forward = unwrap_forward(type(module).forward)
    except RewriteRefused as exc:
        logger.debug("no trace of %s: %s", type(module).__name__, exc)
        return Traced(None, _stop_reason(exc, type(module).forward, type(module)))
    parameters = forward_parameters(module)
    concrete = {name: None for name in CACHE_ARGUMENTS if name in parameters}
    if none_defaults:
        concrete.update((p.name, None) for p in list(parameters.values())[2:] if p.default is None)
    varkw = next(
        (p.name for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
    )
    positional = [
        p.name
        for p in list(parameters.values())[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    tracer = LeafTracer(
        varkw=varkw,
        input_name=positional[0] if positional else None,
        decide_branches=decide_branches,
    )
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_preserved_state(module))
            stack.enter_context(preserved_globals())
            for patch in _attention_patches(getattr(forward, "__globals__", {})):
                stack.enter_context(patch)
            return Traced(tracer.trace(module, concrete_args=concrete or None), None)
    except Exception as exc:
        logger.debug("partial trace of %s: %s: %s", type(module).__name__, type(exc).__name__, exc)
        return Traced(getattr(tracer, "graph", None), _stop_reason(exc, forward, type(module)))
