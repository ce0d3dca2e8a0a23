"""Proving a norm's source free of tensor writes, which its traced dataflow cannot show."""

from __future__ import annotations

import ast
import inspect

from torch import nn

from fusion import alias
from fusion.errors import RewriteRefused
from fusion.source import method_source


def check_write_free(module: nn.Module, name: str = "forward", depth: int = 0) -> None:
    """Refuse unless `module`'s `name` method (and the helper methods it calls on `self`)
    provably writes no tensor: no augmented assignment, no store through a subscript or
    attribute, and no call that may write its arguments (`fusion.alias` decides which calls
    are pure).

    The traced graph cannot show a write: fx records `h *= s` as `h = h * s`, and a
    discarded in-place call (`F.relu(x, inplace=True)`) has no user in the dataflow. Yet with
    a float32 input `x.to(torch.float32)` is `x` itself, so such a write changes the caller's
    tensor (a residual kept before the norm) and every later read of it, while FusedRMSNorm
    is a pure function of its input. No Transformers RMSNorm writes anything.
    """
    cls = type(module)
    if depth > 3:
        raise RewriteRefused(f"{cls.__name__}.{name}: helper calls nest too deeply to check")
    funcdef = method_source(cls, name)
    shadowed = alias.local_names(funcdef) & (alias.PURE_BUILTINS | alias.PURE_NAMESPACES)
    for node in ast.walk(funcdef):
        if isinstance(node, ast.AugAssign):
            raise RewriteRefused(
                f"{cls.__name__}.{name} has an augmented assignment (may write a tensor in place)"
            )
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            raise RewriteRefused(f"{cls.__name__}.{name} stores through a subscript or attribute")
        if not isinstance(node, ast.Call) or alias._known_pure(node, module, shadowed):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
            and inspect.isfunction(getattr(cls, func.attr, None))
            and not alias.writes_through_args(node)
        ):
            check_write_free(module, func.attr, depth + 1)  # a helper such as Gemma's _norm
            continue
        raise RewriteRefused(
            f"{cls.__name__}.{name} calls {ast.unparse(func)}, which may write its arguments"
        )
