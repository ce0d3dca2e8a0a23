"""Experts-only fusion: the experts child of a block refused as a whole, fused alone.

The block's forward is left exactly as it is (whatever its router, return value or calling
convention); only its experts child is replaced by a `FusedExperts`, which computes the
same experts function for every call it covers and runs the original module on any other.
What must hold, each checked by structure, never by a class name:

- the child computes Transformers' experts function, proven by identity, never by a sample
  (`fusion.fusers.moe.provenance`): its class's `forward` is Transformers' experts
  dispatcher over a Transformers model's own eager forward, and the configured
  implementation resolves to a known Transformers experts function (or that eager forward,
  with the gating it was written with); the instance carries the interface's flags: gated
  (`has_gate`), no post-expert norm, not expert-parallel, `num_experts` the weights' count;
- it holds exactly `gate_up_proj` and `down_proj` (and their `_bias` rows iff `has_bias`)
  in the shapes of its `is_transposed` layout, no buffer and no other state, one dtype;
- its gating `_apply_gate` is a proven `GateProgram`, the same at every row count and in
  both modes, and every attribute its traces read can be guarded (`fusion.fusers.moe.gate`);
  `FusedExperts` guards them, the functions proven and the flags per call;
- nothing else runs when it is called: no hooks on it or inside it, no call path or
  instance `forward` of its own;
- the block reaches it only by calling it: every `self.<experts>` in the block's forward
  source is a call, and the name is never used as a string (an attribute read of the
  experts would fail on, or bypass, the fused module).

As extra evidence (not the acceptance), the fused module is also run once per kind of
instance on the module's own weights and must agree to rounding with the module under its
configured implementation.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import torch
from torch import nn

from fusion import numerics
from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.analysis.reads import portable_keys
from fusion.analysis.source import method_source, self_refs
from fusion.errors import RewriteRefused
from fusion.fusers.moe.gate import proven_gate
from fusion.fusers.moe.provenance import experts_dispatch
from fusion.runtime.experts import Dispatch, FusedExperts, GateProgram

_REQUIRED_FLAGS = {"has_gate": True, "has_post_expert_norm": False, "_is_expert_parallel": False}
"""Interface flags (read from the instance) of the experts function `FusedExperts` computes;
an absent flag takes the only value an older interface had (Transformers 5.0 sets only
`has_bias` and `is_transposed`)."""


@dataclass(frozen=True)
class ExpertsMatch:
    """What one kind of experts module computes, for `FusedExperts`."""

    experts_name: str
    program: GateProgram
    transposed: bool
    bias: bool
    block_reason: str
    """Why the block was not fused as a whole (kept for the report)."""
    reads: tuple[tuple[str, str], ...] = ()
    """`(module path in the experts, attribute)` the gating's traces read (guarded)."""
    read_keys: tuple = ()
    """Their values on the matched instance (`portable_keys`): the program's constants."""

    def check_instance(self, experts: nn.Module) -> None:
        """Refuse an instance whose read attributes differ from the matched one's (its
        program would have other constants)."""
        if portable_keys(experts, self.reads) != self.read_keys:
            raise RewriteRefused(
                "the experts' gating attributes differ from the instance the program was "
                f"read from ({', '.join(f'{p}.{n}'.lstrip('.') for p, n in self.reads)})"
            )

    def describe(self) -> str:
        layout = ", transposed" if self.transposed else ""
        bias = ", biased" if self.bias else ""
        return (
            f"{self.experts_name}: {self.program.describe()}{layout}{bias} -> FusedExperts "
            f"(experts alone; the block: {self.block_reason})"
        )


def check_interface(experts: nn.Module) -> Dispatch:
    """The proven dispatch of `experts` after checking it computes the gated experts
    function (its functions by identity, its flags by value); RewriteRefused otherwise."""
    name = type(experts).__name__
    wrapped = getattr(type(experts).forward, "__wrapped__", None)
    if wrapped is None or not hasattr(experts, "config") or not hasattr(experts, "has_bias"):
        raise RewriteRefused(f"{name} is not a Transformers experts-interface module")
    if not callable(getattr(type(experts), "_apply_gate", None)):
        raise RewriteRefused(f"{name} has no gating function")
    for flag, expected in _REQUIRED_FLAGS.items():
        value = getattr(experts, flag, expected)
        if value != expected:
            raise RewriteRefused(f"experts {flag}={value!r} (need {expected})")
    dispatch = experts_dispatch(experts)
    count = getattr(experts, "num_experts", None)
    if count != experts.gate_up_proj.shape[0]:
        raise RewriteRefused(
            f"experts num_experts={count!r} but {experts.gate_up_proj.shape[0]} expert weights"
        )
    return dispatch


def instance_hazard(experts: nn.Module, name: str) -> str | None:
    """What makes calling this instance run more than its class's forward (None if
    nothing): hooks on it or inside it, a call path, `forward` or gating of its own. A fused
    module replacing it, or a kernel bypassing it, would silently drop that."""
    for child_name, child in [("", experts), *experts.named_modules()]:
        hooks = has_hooks(child)
        if hooks:
            return f"{name}{'.' + child_name if child_name else ''} has {hooks}"
    own = own_call_path(experts)
    if own or "forward" in experts.__dict__ or "_apply_gate" in experts.__dict__:
        return f"{name} has its own {own or 'forward or gating on the instance'}"
    return None


def expert_layout(experts: nn.Module) -> tuple[bool, bool, int]:
    """(transposed, bias, gate_up output width) after checking the parameter layout."""
    transposed, bias = bool(getattr(experts, "is_transposed", False)), bool(experts.has_bias)
    names = {"gate_up_proj", "down_proj"} | (
        {"gate_up_proj_bias", "down_proj_bias"} if bias else set()
    )
    params = dict(experts.named_parameters())
    if set(params) != names or list(experts.buffers()):
        raise RewriteRefused(f"experts hold {sorted(params)} (need {sorted(names)}, no buffers)")
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.ndim != 3 or down.ndim != 3:
        raise RewriteRefused("expert weights are not 3-D")
    if transposed:
        (num, hidden, width), (num_d, _, hidden_d) = gate_up.shape, down.shape
    else:
        (num, width, hidden), (num_d, hidden_d, _) = gate_up.shape, down.shape
    if (num_d, hidden_d) != (num, hidden):
        raise RewriteRefused(f"expert shapes {tuple(gate_up.shape)} / {tuple(down.shape)}")
    if bias and (
        tuple(params["gate_up_proj_bias"].shape) != (num, width)
        or tuple(params["down_proj_bias"].shape) != (num, hidden)
    ):
        raise RewriteRefused("expert bias shapes do not fit the weights")
    if (
        len({p.dtype for p in params.values()}) != 1
        or len({p.device for p in params.values()}) != 1
    ):
        raise RewriteRefused("expert parameters differ in dtype or device")
    return transposed, bias, width


def _block_only_calls(module: nn.Module, experts_name: str) -> None:
    """Refuse unless the block's forward uses `self.<experts_name>` only as a callee."""
    funcdef = method_source(type(module))
    nodes = list(ast.walk(funcdef))
    callees = {id(node.func) for node in nodes if isinstance(node, ast.Call)}
    refs = self_refs(funcdef, experts_name)
    if not refs:
        raise RewriteRefused(f"the block's forward does not call self.{experts_name}")
    if any(id(ref) not in callees for ref in refs):
        raise RewriteRefused(f"the block reads self.{experts_name} other than by calling it")
    if any(isinstance(n, ast.Constant) and n.value == experts_name for n in nodes):
        raise RewriteRefused(f"the block names {experts_name} as a string")


def match_experts_only(module: nn.Module, experts_name: str, block_reason: str) -> ExpertsMatch:
    """The experts-only match of `module`'s experts child, structurally and numerically
    checked (see the module docstring); RewriteRefused with the reason otherwise."""
    experts = module.get_submodule(experts_name)
    check_interface(experts)
    transposed, bias, width = expert_layout(experts)
    _block_only_calls(module, experts_name)
    gate = proven_gate(experts, width)
    found = ExpertsMatch(
        experts_name,
        gate.program,
        transposed,
        bias,
        block_reason,
        gate.reads,
        portable_keys(experts, gate.reads),
    )
    check_experts(experts, found)
    return found


def build_fused_experts(experts: nn.Module, found: ExpertsMatch, backend: str) -> FusedExperts:
    """The `FusedExperts` for `experts` (sharing its parameter objects: nothing is copied,
    so the state dict and every later weight edit are the unfused module's), guarding the
    attributes the program was read with on this instance, and its proven dispatch."""
    found.check_instance(experts)
    reads = tuple((experts.get_submodule(path), name) for path, name in found.reads)
    fused = FusedExperts(
        experts,
        program=found.program,
        transposed=found.transposed,
        backend=backend,
        reads=reads,
        dispatch=check_interface(experts),
    )
    fused.train(experts.training)
    return fused


def _sample(experts: nn.Module, found: ExpertsMatch) -> tuple[torch.Tensor, ...]:
    """(hidden [16, H], distinct top-2 ids, weights) in the experts' dtype and device."""
    weight = experts.gate_up_proj
    num, hidden = weight.shape[0], weight.shape[1 if found.transposed else 2]
    generator = torch.Generator().manual_seed(20240602)
    x = torch.randn(16, hidden, generator=generator)
    top_k = min(2, num)
    ids = torch.randn(16, num, generator=generator).topk(top_k, dim=-1).indices
    weights = torch.rand(16, top_k, generator=generator)
    device, dtype = weight.device, weight.dtype
    return x.to(device, dtype), ids.to(device), weights.to(device, dtype)


def check_experts(experts: nn.Module, found: ExpertsMatch) -> None:
    """Extra evidence, after the proof: refuse unless the fused module (torch reference
    kernels) agrees to rounding with `experts` as configured, on random routed inputs. (The
    eager forward is not compared: a call under another implementation than the configured
    one runs the original module itself.)"""
    if experts.gate_up_proj.device.type == "meta":
        return  # nothing to compute on; the structure was proven
    fused = build_fused_experts(experts, found, "torch")
    # The class's forward, never the instance's call path: the match stands for the class.
    configured = type(experts).forward
    x, ids, weights = _sample(experts, found)
    try:
        with torch.no_grad():
            actual = fused.forward(x, ids, weights)
            expected = configured(experts, x, ids, weights)
    except Exception as exc:
        raise RewriteRefused(f"experts check failed to run: {type(exc).__name__}: {exc}") from exc
    if not torch.is_tensor(expected) or expected.shape != actual.shape:
        raise RewriteRefused("experts do not return one [T, H] tensor")
    if expected.dtype != actual.dtype:
        raise RewriteRefused(f"experts return {expected.dtype}, fused {actual.dtype}")
    error = numerics.relative_error(actual, expected)
    if not numerics.self_check_passes(error, actual.dtype):  # NaN refuses too
        raise RewriteRefused(f"fused experts differ from the experts by {error:.2e}")
