"""Forwards and parsing helpers the source tests share: a plain forward (`Plain`), a decorator
that `functools.wraps` (`passthrough`), and finding a def or a call in parsed source.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def parse_def(text: str) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(text)).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


def find_call(funcdef: ast.FunctionDef, name: str, nth: int = 0) -> ast.Call:
    calls = [
        n
        for n in ast.walk(funcdef)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
    ]
    return calls[nth]


def passthrough(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        y: torch.Tensor = self.p(x)
        return y * scale
