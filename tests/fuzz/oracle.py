"""The fuzzing oracle: import a generated module, fuse a copy, and judge the result.

`check(generated, seed)` answers one question per example: after `fusion.fuse`, is the
module either untouched, or computing the same function? Concretely, with float32 weights
and fresh random inputs:

- `fusion.fuse` returns (never raises);
- when nothing was applied, the module is exactly as it was (children, parameters, no
  instance-level forward);
- the fused forward does not raise where the unfused one did not;
- every output agrees with the unfused output to a relative error of `TOLERANCE`, and so
  does every input the forward mutates (tensors, and the state of objects such as a KV
  cache passed in);
- with one stacked product per merged projection (`_stacked_failure`: the path a kernel
  measured faster takes, its output split into pieces laid out as the rewrite asked; the
  default policy computes each shard apart), outputs and mutated inputs agree too, and so
  they do on the route around the rewrite (every merged product measured to lose: the
  rewritten forward runs its class's original on the fused state, `fusion.runtime.routes`);
- gradients agree (`_gradient_failure`): a second forward with the first floating input
  requiring grad, backward of a fixed random projection of the outputs; the input's gradient
  and every parameter's (mapped to unfused names) to `GRAD_TOLERANCE`. A projection moved
  out of its `no_grad` region computes the same values and a different gradient;
- the ambient state around the forward is obeyed (`AMBIENT`): under CPU autocast (bfloat16)
  every output has the unfused dtype and agrees to bfloat16 rounding; under a
  `__torch_function__` mode that shifts every matrix product's result, outputs agree as
  without it; in both, every module returns the unfused dtype (`dtype_mismatch`)
  (a kernel that bypasses the dispatcher misses the shift).

Forwards run with autograd enabled (the default mode a user calls a model in), which is the
stricter mode: in-place writes to views are checked there.

The comparisons it makes are in `tests.fuzz.comparisons`; its verdicts (`Failure`, `Outcome`)
and their tally in `tests.fuzz.tally`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import linecache
import math
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

import fusion
from fusion.fusers import registry
from fusion.kernels.policy import POLICY
from fusion.report import FusionReport
from fusion.runtime.checkpoint import unfused_named
from harness.oracles.lifecycle import double_child, dtype_mismatch, guarded_children, output_dtypes
from tests.fusion.merged_paths import measured_elsewhere, measured_references, stacked_products
from tests.fuzz.comparisons import compare, same_state, state, structure
from tests.fuzz.edits import Edit, EditSpec, patches, resolve
from tests.fuzz.strategies import GeneratedModule
from tests.fuzz.tally import Failure, Outcome

TOLERANCE = 1e-5
"""Largest relative error (max |fused - unfused| / max |unfused|) a fused output may show."""

FAILURE_KINDS = (
    "fuse-error",  # fusion.fuse raised
    "refused-but-changed",  # nothing applied, yet the module changed
    "fused-forward-error",  # the fused forward raised where the unfused one did not
    "module-parity",  # an output differs beyond TOLERANCE
    "input-state",  # an input the forward mutates ends in a different state
    "gradient-parity",  # an input or parameter gradient differs beyond GRAD_TOLERANCE
    "ambient-state",  # under autocast or a torch-function mode, an output differs
    "premise-change",  # with a guarded child replaced after fusing, an output differs
    "edit-error",  # a post-fuse edit the unfused model takes raised on the fused model
)

GRAD_TOLERANCE = 1e-4
"""Largest relative error of a gradient: a backward sums the same terms in another order
(merged GEMMs), one more rounding step than the forward."""

AUTOCAST_TOLERANCE = 5e-2
"""Largest relative error of an output under bfloat16 autocast (8 significant bits, a few
roundings along a small module); a changed dtype is caught exactly, whatever this is."""


class ShiftProducts(torch.overrides.TorchFunctionMode):
    """Adds 0.125 to the result of every matrix product (`F.linear`, `mm`, `matmul`, `bmm`,
    `addmm`, `@`): a user's `__torch_function__` mode. A merged or grouped product shifts
    each of its pieces as the separate products were shifted, so the function stays the
    same; a kernel that computes a product without the dispatcher loses the shift."""

    PRODUCTS = frozenset(
        {
            torch.nn.functional.linear,
            torch.mm,
            torch.matmul,
            torch.bmm,
            torch.addmm,
            torch.Tensor.__matmul__,
            torch.Tensor.mm,
            torch.Tensor.matmul,
            torch.Tensor.bmm,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in self.PRODUCTS and isinstance(result, torch.Tensor):
            if kwargs.get("out") is not None:
                result.add_(0.125)  # the caller reads the `out=` tensor, not the value
            else:
                result = result + 0.125
        return result


AMBIENT: dict[str, tuple[Any, float]] = {
    "autocast-bf16": (lambda: torch.autocast("cpu", dtype=torch.bfloat16), AUTOCAST_TOLERANCE),
    "torch-function-mode": (ShiftProducts, TOLERANCE),
}
"""{name: (context factory, tolerance)}: the ambient states a forward is re-run under."""

EXACT_FUSERS = frozenset({"rmsnorm"})
"""Fusers whose result is the original's bit for bit at every dtype pair they run at (a norm
is proven per (input, weight) dtype pair and runs the original elsewhere): where only they
applied, the casts of `CASTS` are compared exactly."""

CASTS: dict[str, tuple[torch.dtype, float]] = {
    "a bfloat16 cast": (torch.bfloat16, AUTOCAST_TOLERANCE),
}
"""{name: (dtype, tolerance)}: the dtypes both models are cast to (`Module.to`, inputs too)
and re-run in: a fused norm is proven per (input, weight) dtype pair and falls back at a
pair it did not prove (a reduced-dtype `pow(v, -0.5)`), a merged product runs in the
weights' dtype; a kernel run at a pair it was not proven for shows here."""

_COUNTER = itertools.count()


# -- loading --------------------------------------------------------------------------------------


@contextmanager
def loaded(generated: GeneratedModule, directory: Path) -> Iterator[ModuleType]:
    """Write `generated.source` to a uniquely named file in `directory`, import it, and
    forget it afterwards (module table, line cache, file, fusion's match cache), so that
    thousands of examples do not accumulate memory."""
    name = f"fuzz_generated_{next(_COUNTER)}"
    path = directory / f"{name}.py"
    path.write_text(generated.source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        linecache.cache.pop(str(path), None)
        path.unlink(missing_ok=True)
        registry.clear_cache()


def build(module: ModuleType, seed: int) -> nn.Module:
    """The generated module's `build()`, with weights drawn from `seed`."""
    torch.manual_seed(seed)
    built = module.build()
    built.float()
    return built


def make_inputs(module: ModuleType, seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random inputs for one forward, from `seed`."""
    return module.make_inputs(torch.Generator().manual_seed(seed + 1))


def _plan(module: nn.Module) -> FusionReport | None:
    """What `fusion.plan` decides for a copy (the forward sources for a repro bundle when
    `fuse` itself raised), or None when planning raises too."""
    try:
        return fusion.plan(copy.deepcopy(module))
    except Exception:
        return None


def _tail(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])


# -- the check ------------------------------------------------------------------------------------


def check(generated: GeneratedModule, seed: int, directory: Path) -> Outcome:
    """Build, fuse a deep copy, run both on the same fresh inputs, and judge: with routes
    closed (`KernelPolicy.routing`), so rewritten forwards run their rewrites; the route is
    judged as a path of its own (`measured_references`)."""
    with loaded(generated, directory) as module, POLICY.routing(False):
        original = build(module, seed)
        fused = copy.deepcopy(original)
        before = structure(fused)
        try:
            report = fusion.fuse(fused)
        except Exception as exc:
            failure = Failure("fuse-error", f"{type(exc).__name__}: {exc}", _tail(exc))
            return Outcome("fused", _plan(original), failure)
        status = "fused" if report.applied else "refused"
        if not report.applied and (structure(fused) != before or not same_state(original, fused)):
            return Outcome(
                status,
                report,
                Failure("refused-but-changed", "nothing was applied but the module changed"),
            )
        # Copies for the gradient and ambient passes, taken before any forward: a forward may
        # store a non-leaf tensor on the module (`self.last = x`), which deepcopy refuses.
        pristine = copy.deepcopy((original, fused)) if status == "fused" else None
        args, kwargs = make_inputs(module, seed)
        args_fused, kwargs_fused = copy.deepcopy((args, kwargs))
        try:
            expected = original(*args, **kwargs)
        except Exception as exc:
            return Outcome("crashed", report, crash=f"{type(exc).__name__}: {exc}")
        try:
            actual = fused(*args_fused, **kwargs_fused)
        except Exception as exc:
            return Outcome(
                status,
                report,
                Failure("fused-forward-error", f"{type(exc).__name__}: {exc}", _tail(exc)),
            )
        error, where = compare(state(expected), state(actual), "output")
        if error > TOLERANCE:
            return Outcome(
                status,
                report,
                Failure(
                    "module-parity",
                    f"{where} differs (relative error {error:.3g})",
                    observed=error,
                    tolerance=TOLERANCE,
                ),
            )
        error, where = compare(state((args, kwargs)), state((args_fused, kwargs_fused)), "inputs")
        if error > TOLERANCE:
            return Outcome(
                status,
                report,
                Failure(
                    "input-state",
                    f"{where} ends in another state (relative error {error:.3g})",
                    observed=error,
                    tolerance=TOLERANCE,
                ),
            )
        if pristine is None:
            # refused: checked above to be the module as it was, the same function in every
            # state
            return Outcome(status, report)
        failure = _gradient_failure(module, seed, *pristine)
        failure = failure or _stacked_failure(module, seed, *pristine)
        failure = failure or _stacked_failure(
            module, seed, *pristine, path=measured_references, label="on the route"
        )
        failure = failure or _stacked_failure(
            module, seed, *pristine, path=measured_elsewhere, label="on the row-bucket route"
        )
        exact = all(applied.fuser in EXACT_FUSERS for applied in report.applied)
        failure = failure or _ambient_failure(module, seed, *pristine, exact_casts=exact)
        failure = failure or _premise_failure(module, seed, *pristine)
        return Outcome(status, report, failure)


def _first_float(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """(container, key) of the first floating-point tensor input, or None."""
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return args, index
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return kwargs, key
    return None


def _outputs(value: Any) -> list[torch.Tensor]:
    """Every floating tensor reachable in an output (tuples, lists, dicts), in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _outputs(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _outputs(item)]
    return []


def _backward(model: nn.Module, module: ModuleType, seed: int) -> tuple[Any, dict[str, Any]]:
    """(input gradient, {parameter: gradient} in unfused names) of a forward on fresh inputs
    whose first floating input requires grad (a non-leaf, so in-place writes stay legal),
    backward of the outputs weighted by a fixed random draw."""
    args, kwargs = make_inputs(module, seed)
    args = list(args)
    found = _first_float(args, kwargs)
    leaf = None
    if found is not None:
        container, key = found
        leaf = container[key].detach().clone().requires_grad_(True)
        container[key] = leaf * 1.0
    model.zero_grad(set_to_none=True)
    outputs = [t for t in _outputs(model(*args, **kwargs)) if t.requires_grad]
    if not outputs:
        return None, {}
    generator = torch.Generator().manual_seed(seed + 7)
    total = sum(
        (t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum() for t in outputs
    )
    total.backward()
    grads = unfused_named(model, {n: p.grad for n, p in model.named_parameters()})
    return (None if leaf is None else leaf.grad), grads


def gradient_error(
    want: tuple[Any, dict[str, Any]], got: tuple[Any, dict[str, Any]]
) -> tuple[float, str]:
    """The largest absolute gradient difference over the largest unfused gradient magnitude,
    and where. One scale for all tensors: a gradient that is zero by symmetry (a key bias
    under softmax) is rounding noise on both sides, which a per-tensor relative error would
    blow up. Infinite where one side has a gradient the other lacks, or shapes differ."""
    pairs = [("input", want[0], got[0])]
    pairs += [(name, grad, got[1].get(name)) for name, grad in sorted(want[1].items())]
    if set(want[1]) != set(got[1]):
        return math.inf, f"gradient names {sorted(set(want[1]) ^ set(got[1]))[:3]}"
    scale = max(
        (float(w.detach().abs().max()) for _, w, _ in pairs if w is not None and w.numel()),
        default=0.0,
    )
    worst: tuple[float, str] = (0.0, "gradient")
    for name, w, g in pairs:
        if (w is None) != (g is None):
            present = g if w is None else w
            if not bool((present == 0).all()):
                return math.inf, f"gradient of {name}: {'missing' if g is None else 'extra'}"
            # None against an all-zero gradient: a merged GEMM gives a shard whose output
            # is unused a zero gradient where the unfused projection, never called, has
            # None (an optimizer with weight decay treats the two differently). A known
            # divergence of the merged-parameter design, recorded for issue 25 (each
            # Parameter keeps its own gradient); not counted here, so the oracle keeps
            # judging values.
            continue
        if w is None:
            continue
        if w.shape != g.shape or not torch.equal(torch.isnan(w), torch.isnan(g)):
            return math.inf, f"gradient of {name}: shape or NaN positions"
        diff = float((w.double() - g.double()).nan_to_num().abs().max()) if w.numel() else 0.0
        error = diff / scale if scale > 0 else diff
        if error > worst[0]:
            worst = (error, f"gradient of {name}")
    return worst


def _gradient_failure(
    module: ModuleType, seed: int, original: nn.Module, fused: nn.Module
) -> Failure | None:
    """`gradient-parity` when a gradient differs; None when they agree or when the unfused
    model cannot run backward (nothing to compare)."""
    try:
        want = _backward(copy.deepcopy(original), module, seed)
    except Exception:
        return None
    try:
        got = _backward(copy.deepcopy(fused), module, seed)
    except Exception as exc:
        return Failure("fused-forward-error", f"backward: {type(exc).__name__}: {exc}", _tail(exc))
    error, where = gradient_error(want, got)
    if error > GRAD_TOLERANCE:
        return Failure(
            "gradient-parity",
            f"{where} differs (relative error {error:.3g})",
            observed=error,
            tolerance=GRAD_TOLERANCE,
        )
    return None


def _stacked_failure(
    module: ModuleType,
    seed: int,
    original: nn.Module,
    fused: nn.Module,
    path: Callable[[nn.Module], AbstractContextManager[None]] = stacked_products,
    label: str = "with one stacked product",
) -> Failure | None:
    """The path a kernel measured faster takes, which the default policy (the reference:
    each shard's own product) never does: without autograd, every merged projection as one
    stacked product, its output split into pieces laid out as the rewrite asked (views,
    contiguous, fresh copies); or, with `path=measured_references`, the route a calibrated
    machine takes where no kernel wins (the class's original forward on the fused state);
    or, with `path=measured_elsewhere`, the same route taken by the row-bucket rule (winners
    only at rows the inputs never have, the process's quiet lane closed).
    Outputs and mutated inputs must agree with the unfused forward's; `module-parity` /
    `input-state` / `fused-forward-error` otherwise, the message (`label`) saying which
    path."""
    args, kwargs = make_inputs(module, seed)
    args_fused, kwargs_fused = copy.deepcopy((args, kwargs))
    unfused_copy, fused_copy = copy.deepcopy(original), copy.deepcopy(fused)
    try:
        with torch.no_grad():
            expected = unfused_copy(*args, **kwargs)
    except Exception:
        return None  # the unfused forward needs autograd: nothing to compare
    try:
        with torch.no_grad(), path(fused_copy):
            actual = fused_copy(*args_fused, **kwargs_fused)
    except Exception as exc:
        return Failure(
            "fused-forward-error",
            f"{label}: {type(exc).__name__}: {exc}",
            _tail(exc),
        )
    for kind, want, got, what in (
        ("module-parity", expected, actual, "output"),
        ("input-state", (args, kwargs), (args_fused, kwargs_fused), "inputs"),
    ):
        error, where = compare(state(want), state(got), what)
        if error > TOLERANCE:
            return Failure(
                kind,
                f"{label}: {where} differs (relative error {error:.3g})",
                observed=error,
                tolerance=TOLERANCE,
            )
    return None


def _ambient_failure(
    module: ModuleType,
    seed: int,
    original: nn.Module,
    fused: nn.Module,
    exact_casts: bool = False,
) -> Failure | None:
    """`ambient-state` when, under one of `AMBIENT` or cast to one of `CASTS`, the fused
    output differs (dtype or value) from the unfused output in the same state; None
    otherwise, and for a state the unfused forward itself cannot run in. `exact_casts`:
    the casts must agree bit for bit (every fusion applied is a norm, proven bit-exact per
    dtype pair and running the original at a pair it did not prove)."""
    states = [(f"under {name}", make, tol, None) for name, (make, tol) in AMBIENT.items()]
    states += [
        (f"under {name}", nullcontext, 0.0 if exact_casts else tol, dtype)
        for name, (dtype, tol) in CASTS.items()
    ]
    for name, context, tolerance, dtype in states:
        args, kwargs = _cast(make_inputs(module, seed), dtype)
        args_fused, kwargs_fused = copy.deepcopy((args, kwargs))
        unfused_copy, fused_copy = _cast(copy.deepcopy((original, fused)), dtype)
        try:
            with torch.no_grad(), context(), output_dtypes(unfused_copy) as want:
                expected = unfused_copy(*args, **kwargs)
        except Exception:
            continue
        try:
            with torch.no_grad(), context(), output_dtypes(fused_copy) as got:
                actual = fused_copy(*args_fused, **kwargs_fused)
        except Exception as exc:
            return Failure(
                "fused-forward-error", f"{name}: {type(exc).__name__}: {exc}", _tail(exc)
            )
        mismatch = dtype_mismatch(want, got)
        if mismatch:
            return Failure("ambient-state", f"{name}: {mismatch}")
        error, where = compare(state(expected), state(actual), "output")
        if error > tolerance:
            return Failure(
                "ambient-state",
                f"{name}: {where} differs (relative error {error:.3g})",
                observed=error,
                tolerance=tolerance,
            )
    return None


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    """`value` with every floating tensor and module in it cast to `dtype` (a module in
    place, as `Module.to` does); `value` itself when `dtype` is None."""
    if dtype is None:
        return value
    if isinstance(value, nn.Module):
        return value.to(dtype)
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _cast(item, dtype) for key, item in value.items()}
    return value


PREMISE_SITES = 2
"""Guarded children replaced per fused example (`_premise_failure`)."""


def _premise_failure(
    module: ModuleType, seed: int, original: nn.Module, fused: nn.Module
) -> Failure | None:
    """`premise-change` when, with a child a rewritten forward's guards watch replaced after
    fusing, in both models, by a wrapper that doubles its output (a user's LoRA wrapper or
    any replacement: `harness.oracles.lifecycle.double_child`), the outputs differ: the fused forward kept
    running on a proof whose premise is gone. None otherwise, and where the unfused forward
    cannot run with the replacement."""
    for qualname, name in guarded_children(fused)[:PREMISE_SITES]:
        unfused_copy, fused_copy = copy.deepcopy(original), copy.deepcopy(fused)
        if double_child((unfused_copy, fused_copy), qualname, name) is None:
            continue
        where = f"{qualname}.{name}" if qualname else name
        args, kwargs = make_inputs(module, seed)
        args_fused, kwargs_fused = copy.deepcopy((args, kwargs))
        try:
            with torch.no_grad():
                expected = unfused_copy(*args, **kwargs)
        except Exception:
            continue
        try:
            with torch.no_grad():
                actual = fused_copy(*args_fused, **kwargs_fused)
        except Exception as exc:
            return Failure(
                "fused-forward-error",
                f"with {where} replaced: {type(exc).__name__}: {exc}",
                _tail(exc),
            )
        error, at = compare(state(expected), state(actual), "output")
        if error > TOLERANCE:
            return Failure(
                "premise-change",
                f"with {where} replaced after fusing: {at} differs (relative error {error:.3g})",
                observed=error,
                tolerance=TOLERANCE,
            )
    return None


def _labelled(failure: Failure | None, label: str) -> Failure | None:
    """`failure` with `label` in front of its message."""
    if failure is None:
        return None
    return dataclasses.replace(failure, message=f"{label}: {failure.message}")


def _pair_failure(
    module: ModuleType, seed: int, unfused: nn.Module, fused: nn.Module, label: str
) -> tuple[Failure | None, str]:
    """(failure, why not judged) of one forward of each model, with autograd on, on fresh
    inputs: outputs and mutated inputs must agree to TOLERANCE. Where the unfused forward
    raises, the fused one must raise too: then (None, why); a fused forward that returns
    is a `module-parity` failure (it computes something the original does not)."""
    args, kwargs = make_inputs(module, seed)
    args_fused, kwargs_fused = copy.deepcopy((args, kwargs))
    try:
        expected = unfused(*args, **kwargs)
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        try:
            fused(*args_fused, **kwargs_fused)
        except Exception:
            return None, f"{label}: both forwards raise ({raised})"
        return Failure(
            "module-parity", f"{label}: the unfused forward raises ({raised}), the fused returns"
        ), ""
    try:
        actual = fused(*args_fused, **kwargs_fused)
    except Exception as exc:
        return Failure(
            "fused-forward-error", f"{label}: {type(exc).__name__}: {exc}", _tail(exc)
        ), ""
    for kind, want, got, what in (
        ("module-parity", expected, actual, "output"),
        ("input-state", (args, kwargs), (args_fused, kwargs_fused), "inputs"),
    ):
        error, where = compare(state(want), state(got), what)
        if error > TOLERANCE:
            return Failure(
                kind,
                f"{label}: {where} differs (relative error {error:.3g})",
                observed=error,
                tolerance=TOLERANCE,
            ), ""
    return None, ""


def _apply_edit(edit: Edit, held: Any, original: nn.Module, fused: nn.Module) -> Any:
    """Apply `edit` to both models: (unfused, fused) to run from then on; a string (why
    discarded) when the unfused model refuses it; a `Failure` (`edit-error`) when only the
    fused model does."""
    try:
        if edit.shared is not None:
            edit.shared(held)
        if edit.per_model is not None:
            original = edit.per_model(original)
    except Exception as exc:
        return f"the unfused model refuses the edit ({type(exc).__name__}: {exc})"
    if edit.per_model is not None:
        try:
            fused = edit.per_model(fused)
        except Exception as exc:
            return Failure(
                "edit-error",
                f"{edit.description}: the fused model refuses it ({type(exc).__name__}: {exc})",
                _tail(exc),
            )
    return original, fused


def check_edit(generated: GeneratedModule, spec: EditSpec, seed: int, directory: Path) -> Outcome:
    """The post-fuse edit family (issue 43): build, fuse a deep copy, run a first forward,
    then apply the edit `spec` resolves to (tests/fuzz/edits.py) to both models and judge
    them as `check` judges a fused model (outputs, mutated inputs, gradients, the stacked
    product, the route, ambient state). `inference-mode` builds and/or fuses inside
    `torch.inference_mode()` instead, and is judged outside it. Refused modules are not
    edited (the fused copy is the module as it was)."""
    with loaded(generated, directory) as module, POLICY.routing(False):
        edit = resolve(spec, None, module) if spec.kind == "inference-mode" else None
        build_inside = edit is not None and edit.build_in_inference_mode
        with torch.inference_mode(build_inside):
            original = build(module, seed)
            fused = copy.deepcopy(original)
        edit = edit or resolve(spec, original, module)
        if edit is None:
            return Outcome("n/a", crash=f"no {spec.kind} site in this module")
        try:
            with torch.inference_mode(edit.fuse_in_inference_mode):
                report = fusion.fuse(fused)
        except Exception as exc:
            failure = Failure("fuse-error", f"{type(exc).__name__}: {exc}", _tail(exc))
            return Outcome("fused", _plan(original), _labelled(failure, edit.description))
        if not report.applied:
            return Outcome("refused", report)
        if edit.shared is not None or edit.per_model is not None:
            failure, why = _pair_failure(module, seed, original, fused, "before the edit")
            if failure is not None:
                return Outcome("fused", report, failure)
            if why:
                return Outcome("crashed", report, crash=why)
        with patches() as held, warnings.catch_warnings():
            # backward through quantize_dynamic's linears (both models) warns on every call
            warnings.filterwarnings("ignore", message="quantized::linear_dynamic")
            applied = _apply_edit(edit, held, original, fused)
            if isinstance(applied, str):
                return Outcome("discarded", report, crash=applied)
            if isinstance(applied, Failure):
                return Outcome("fused", report, applied)
            original, fused = applied
            label = f"after {edit.description}"
            try:
                pristine = copy.deepcopy((original, fused))
            except Exception as exc:
                pristine = None
                try:
                    copy.deepcopy(original)
                except Exception:
                    pass  # the unfused model cannot be copied either: no copies to judge
                else:
                    failure = Failure(
                        "edit-error",
                        f"{label}: deepcopy of the fused model raises ({type(exc).__name__}: {exc})",
                        _tail(exc),
                    )
                    return Outcome("fused", report, failure)
            # A model built inside inference mode is run as one is: without autograd (its
            # inference-tensor parameters cannot be saved for backward, fused or not).
            with torch.set_grad_enabled(not edit.build_in_inference_mode):
                failure, why = _pair_failure(module, seed, original, fused, label)
            if failure is None and why:
                return Outcome("discarded", report, crash=why)
            if failure is None and pristine is not None:
                failure = _gradient_failure(module, seed, *pristine)
                failure = failure or _stacked_failure(module, seed, *pristine)
                failure = failure or _stacked_failure(
                    module, seed, *pristine, path=measured_references, label="on the route"
                )
                failure = failure or _stacked_failure(
                    module,
                    seed,
                    *pristine,
                    path=measured_elsewhere,
                    label="on the row-bucket route",
                )
                failure = failure or _ambient_failure(module, seed, *pristine)
                failure = _labelled(failure, label)
            return Outcome("fused", report, failure)
