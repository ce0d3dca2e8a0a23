"""Repro bundles for fuzzer failures: the harness's bundle format, for a generated module.

`harness.runner.repro.write_bundle` rebuilds a corpus architecture from a Transformers config; a
generated module has no config, its definition *is* its source text. This adapter writes
the same directory layout, reusing the harness's pieces where they fit:

    bundle.json     the harness fields (architecture "fuzz/<shape>", model_type "generated",
                    config {}, seed, dtype, device, kind, fuser, source class, error, detail,
                    tolerance, observed, signature, versions) plus a `generated` object: the
                    shape, the module file, the oracle's own failure kind, hazards, features
                    and the fusion report
    module.py       the generated module source (build() and make_inputs()): the model is
                    re-created by importing this text, never by unpickling anything
    original.py     forward sources before fusion      } when a fuser rewrote a forward
    rewritten.py    forward sources after fusion       } (harness.runner.repro.source_files)
    forward.diff    their unified diff                 }
    repro.py        self-contained: imports module.py, builds with the seed, fuses a copy,
                    runs both with autograd on, compares; exit 1 if the failure reproduces,
                    0 if not, 2 if the bundle cannot be replayed

What the harness would need to replay these itself (`fusion-harness repro DIR`): a bundle
kind that says "the model is module.py's build(), the inputs make_inputs(seed)", i.e.
`harness.runner.repro.rebuild` dispatching on `model_type == "generated"` to import `module.py`
from the bundle directory, and the oracle's extra failure kinds (`input-state`,
`refused-but-changed`) in `harness.runner.repro.KINDS`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from harness.runner.repro import BUNDLE_FORMAT, source_files, versions
from tests.fuzz.oracle import (
    AUTOCAST_TOLERANCE,
    GRAD_TOLERANCE,
    PREMISE_SITES,
    TOLERANCE,
)
from tests.fuzz.strategies import GeneratedModule
from tests.fuzz.tally import Outcome, outcome_summary

HARNESS_KIND = {
    "fuse-error": "fuse-error",
    "refused-but-changed": "fuse-error",
    "fused-forward-error": "fused-forward-error",
    "module-parity": "module-parity",
    "input-state": "module-parity",
    "gradient-parity": "module-parity",
    "ambient-state": "module-parity",
    "premise-change": "module-parity",
    "edit-error": "fused-forward-error",
}
"""The harness bundle kind closest to each oracle failure kind (the exact one is kept in
`generated.kind`)."""

REPRO_SCRIPT = '''\
"""Replay of a fusion fuzzer failure: {title}

Imports the generated module from module.py (plain source), builds it with the recorded
seed, fuses a deep copy with fusion.fuse, runs both on the same fresh inputs with autograd
on, and compares outputs and the inputs' final state (relative error <= tolerance), then
gradients (a backward of the outputs weighted by a seeded draw) and outputs under CPU
bfloat16 autocast and under a torch-function mode that shifts every matrix product.
Exit status: 1 if a failure reproduces, 0 if not, 2 if the bundle cannot be replayed.
Needs only torch, transformers and the fusion-harness package.
"""

import contextlib
import copy
import importlib.util
import json
import math
import sys
import traceback
from pathlib import Path

import torch
from torch import nn

import fusion
from fusion.kernels.policy import POLICY
from fusion.runtime.checkpoint import unfused_named
from harness.oracles.lifecycle import double_child, dtype_mismatch, guarded_children, watched_children


def load_generated(directory):
    spec = importlib.util.spec_from_file_location("fuzz_repro_module", directory / "module.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # inspect.getsource needs the module registered
    spec.loader.exec_module(module)
    return module


def snapshot(value, depth=0):
    if depth > 6:
        return repr(type(value))
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [snapshot(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {{k: snapshot(v, depth + 1) for k, v in value.items()}}
    if isinstance(value, nn.Module):
        return "<%s>" % type(value).__name__
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {{k: snapshot(v, depth + 1) for k, v in vars(value).items()}}
    return value


def error(a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf
        if not a.is_floating_point():
            return 0.0 if torch.equal(a, b) else math.inf
        a, b = a.double(), b.double()
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            return math.inf
        keep = ~torch.isnan(a)
        a, b = a[keep], b[keep]
        if a.numel() == 0:
            return 0.0
        if not torch.equal(torch.isinf(a), torch.isinf(b)) or not torch.equal(
            a[torch.isinf(a)], b[torch.isinf(b)]
        ):
            return math.inf
        a, b = a[torch.isfinite(a)], b[torch.isfinite(b)]
        if a.numel() == 0:
            return 0.0
        scale = a.abs().max().item()
        diff = (a - b).abs().max().item()
        return diff / scale if scale > 0 else diff
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return math.inf
        return max([error(x, y) for x, y in zip(a, b)], default=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return math.inf
        return max([error(a[k], b[k]) for k in a], default=0.0)
    return 0.0 if a == b else math.inf


def check(directory, fields):
    """The oracle's verdict now: (failure kind or None, message)."""
    generated = fields["generated"]
    module = load_generated(directory)
    torch.manual_seed(fields["seed"])
    original = module.build().float()
    fused = copy.deepcopy(original)
    try:
        report = fusion.fuse(fused)
    except Exception as exc:
        traceback.print_exc()
        return "fuse-error", "%s: %s" % (type(exc).__name__, exc)
    print(report)
    args, kwargs = module.make_inputs(torch.Generator().manual_seed(fields["seed"] + 1))
    fused_args, fused_kwargs = copy.deepcopy((args, kwargs))
    try:
        expected = original(*args, **kwargs)
    except Exception as exc:
        return None, "the unfused forward raises (%s: %s): nothing to compare" % (type(exc).__name__, exc)
    try:
        actual = fused(*fused_args, **fused_kwargs)
    except Exception as exc:
        traceback.print_exc()
        return "fused-forward-error", "%s: %s" % (type(exc).__name__, exc)
    tolerance = generated["tolerance"]
    observed = error(snapshot(expected), snapshot(actual))
    if observed > tolerance:
        return "module-parity", "output relative error %.3g > %g" % (observed, tolerance)
    observed = error(snapshot((args, kwargs)), snapshot((fused_args, fused_kwargs)))
    if observed > tolerance:
        return "input-state", "inputs end in another state (relative error %.3g)" % observed
    seed = fields["seed"]
    try:
        want = backward(copy.deepcopy(original), module, seed)
    except Exception:
        want = None
    if want is not None:
        try:
            got = backward(copy.deepcopy(fused), module, seed)
        except Exception as exc:
            traceback.print_exc()
            return "fused-forward-error", "backward: %s: %s" % (type(exc).__name__, exc)
        observed = gradient_error(want, got)
        if observed > {grad_tolerance!r}:
            return "gradient-parity", "gradient relative error %.3g" % observed
    for name, (context, bound, dtype) in AMBIENT.items():
        args, kwargs = cast(module.make_inputs(torch.Generator().manual_seed(seed + 1)), dtype)
        fused_args, fused_kwargs = copy.deepcopy((args, kwargs))
        unfused_copy, fused_copy = cast(copy.deepcopy((original, fused)), dtype)
        try:
            with torch.no_grad(), context():
                expected, want = run_recording(unfused_copy, args, kwargs)
        except Exception:
            continue
        try:
            with torch.no_grad(), context():
                actual, got = run_recording(fused_copy, fused_args, fused_kwargs)
        except Exception as exc:
            traceback.print_exc()
            return "fused-forward-error", "under %s: %s: %s" % (name, type(exc).__name__, exc)
        mismatch = dtype_mismatch(want, got)
        if mismatch:
            return "ambient-state", "under %s: %s" % (name, mismatch)
        observed = error(snapshot(expected), snapshot(actual))
        if observed > bound:
            return "ambient-state", "under %s: relative error %.3g" % (name, observed)
    for qualname, name in guarded_children(fused)[:{premise_sites!r}]:
        unfused_copy, fused_copy = copy.deepcopy(original), copy.deepcopy(fused)
        if double_child((unfused_copy, fused_copy), qualname, name) is None:
            continue
        args, kwargs = module.make_inputs(torch.Generator().manual_seed(seed + 1))
        fused_args, fused_kwargs = copy.deepcopy((args, kwargs))
        try:
            with torch.no_grad():
                expected = unfused_copy(*args, **kwargs)
        except Exception:
            continue
        try:
            with torch.no_grad():
                actual = fused_copy(*fused_args, **fused_kwargs)
        except Exception as exc:
            traceback.print_exc()
            return "fused-forward-error", "with %s replaced: %s: %s" % (name, type(exc).__name__, exc)
        observed = error(snapshot(expected), snapshot(actual))
        if observed > {tolerance!r}:
            return "premise-change", "with %s replaced: relative error %.3g" % (name, observed)
    return None, "outputs, inputs, gradients, ambient-state outputs and guarded replacements agree"


class ShiftProducts(torch.overrides.TorchFunctionMode):
    PRODUCTS = {{
        torch.nn.functional.linear, torch.mm, torch.matmul, torch.bmm, torch.addmm,
        torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.bmm,
    }}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {{}}
        result = func(*args, **kwargs)
        if func in self.PRODUCTS and isinstance(result, torch.Tensor):
            if kwargs.get("out") is not None:
                result.add_(0.125)
            else:
                result = result + 0.125
        return result


AMBIENT = {{
    "autocast-bf16": (lambda: torch.autocast("cpu", dtype=torch.bfloat16), {autocast_tolerance!r}, None),
    "torch-function-mode": (ShiftProducts, {tolerance!r}, None),
    "a bfloat16 cast": (contextlib.nullcontext, {autocast_tolerance!r}, torch.bfloat16),
}}


def cast(value, dtype):
    """`value` with its floating tensors and modules cast to `dtype` (None: unchanged)."""
    if dtype is None:
        return value
    if isinstance(value, nn.Module):
        return value.to(dtype)
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast(item, dtype) for item in value)
    if isinstance(value, dict):
        return {{key: cast(item, dtype) for key, item in value.items()}}
    return value


def floats(value):
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in floats(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in floats(item)]
    return []


def run_recording(model, args, kwargs):
    """The output, and {{module name: dtype of its first tensor output}} of the forward."""
    dtypes, names = {{}}, {{id(m): n for n, m in model.named_modules()}}

    def record(module, inputs, output):
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(first, torch.Tensor):
            dtypes.setdefault(names[id(module)], first.dtype)

    # not the children a fused forward's guards watch: a hook there runs the original
    skip = watched_children(model)
    handles = [m.register_forward_hook(record) for m in model.modules() if id(m) not in skip]
    try:
        return model(*args, **kwargs), dtypes
    finally:
        for handle in handles:
            handle.remove()


def gradient_error(want, got):
    """Largest absolute difference over the largest unfused gradient (one scale for all)."""
    if (want[0] is None) != (got[0] is None) or set(want[1]) != set(got[1]):
        return math.inf
    pairs = [(want[0], got[0])] + [(w, got[1][n]) for n, w in want[1].items()]
    scale = max([float(w.abs().max()) for w, _ in pairs if w is not None and w.numel()] or [0.0])
    worst = 0.0
    for w, g in pairs:
        if (w is None) != (g is None) or (w is not None and w.shape != g.shape):
            return math.inf
        if w is not None and w.numel():
            diff = float((w.double() - g.double()).nan_to_num().abs().max())
            worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def backward(model, module, seed):
    args, kwargs = module.make_inputs(torch.Generator().manual_seed(seed + 1))
    args = list(args)
    leaf = None
    for container, keys in ((args, range(len(args))), (kwargs, list(kwargs))):
        for key in keys:
            value = container[key]
            if leaf is None and isinstance(value, torch.Tensor) and value.is_floating_point():
                leaf = value.detach().clone().requires_grad_(True)
                container[key] = leaf * 1.0
    model.zero_grad(set_to_none=True)
    outputs = [t for t in floats(model(*args, **kwargs)) if t.requires_grad]
    if not outputs:
        return None
    generator = torch.Generator().manual_seed(seed + 7)
    total = sum((t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum() for t in outputs)
    total.backward()
    grads = unfused_named(model, {{n: p.grad for n, p in model.named_parameters()}})
    return (None if leaf is None else leaf.grad), grads


def main(directory):
    directory = Path(directory)
    try:
        fields = json.loads((directory / "bundle.json").read_text(encoding="utf-8"))
        recorded = fields["generated"]["kind"]
        print("bundle: %s" % fields["generated"]["title"])
        print("recorded: %s: %s" % (recorded, fields["error"]))
        # routes closed, as the fuzzer judged: a rewritten forward runs its rewrite, not
        # the class's original an uncalibrated machine routes to
        with POLICY.routing(False):
            kind, message = check(directory, fields)
    except Exception as exc:
        print("error: cannot replay %s: %s: %s" % (directory, type(exc).__name__, exc))
        return 2
    if kind is None:
        print("does not reproduce (now: %s)" % message)
        return 0
    same = "the same kind" if kind == recorded else "recorded %s" % recorded
    print("REPRODUCES: %s: %s (%s)" % (kind, message, same))
    return 1


if __name__ == "__main__":
    sys.exit(main(Path(__file__).resolve().parent))
'''


def bundle_fields(
    generated: GeneratedModule, seed: int, outcome: Outcome, title: str
) -> dict[str, Any]:
    """bundle.json for a failing example: the harness fields plus `generated`."""
    failure = outcome.failure
    assert failure is not None
    applied = outcome.report.applied if outcome.report else []
    fusers = sorted({r.fuser for r in applied})
    return {
        "format": BUNDLE_FORMAT,
        "versions": versions(),
        "architecture": f"fuzz/{generated.shape}",
        "model_type": "generated",
        "config": {},
        "seed": seed,
        "dtype": "float32",
        "device": "cpu",
        "batch": 0,
        "seq": 0,
        "kind": HARNESS_KIND[failure.kind],
        "qualname": None,
        "fuser": ",".join(fusers) or None,
        "source_class": generated.class_name,
        "error": failure.message,
        "detail": failure.detail,
        "tolerance": failure.tolerance if failure.tolerance is not None else TOLERANCE,
        "observed": _json_number(failure.observed),
        "signature": failure.signature,
        "generated": {
            "format": 1,
            "title": title,
            "shape": generated.shape,
            "module_file": "module.py",
            "kind": failure.kind,
            "tolerance": TOLERANCE,
            "hazards": list(generated.hazards),
            "features": list(generated.features),
            "outcome": outcome_summary(outcome),
        },
    }


def _json_number(value: float | None) -> float | str | None:
    """Strict JSON has no NaN or infinity: those become strings, as in the harness."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


def write_bundle(
    root: Path, name: str, generated: GeneratedModule, seed: int, outcome: Outcome
) -> Path:
    """Write (or replace) the bundle `root/name` for a failing example; return its path.

    Written aside and renamed into place, so a reader never sees half a bundle. Replacing
    is deliberate: while Hypothesis shrinks, each smaller failing example overwrites the
    last, so the bundle left behind holds the shrunk one (the final replay).
    """
    failure = outcome.failure
    assert failure is not None
    title = f"{generated.shape} {generated.class_name}: {failure.kind}: {failure.message}"
    fields = bundle_fields(generated, seed, outcome, title)
    records = outcome.report.applied if outcome.report else []
    files = {
        "bundle.json": json.dumps(fields, indent=2, allow_nan=False) + "\n",
        "module.py": generated.source,
        "repro.py": REPRO_SCRIPT.format(
            title=title.replace('"""', "'''"),
            tolerance=TOLERANCE,
            grad_tolerance=GRAD_TOLERANCE,
            autocast_tolerance=AUTOCAST_TOLERANCE,
            premise_sites=PREMISE_SITES,
        ),
        **source_files([r for r in records if r.original_source is not None]),
    }
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    staging = root / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for file_name, text in files.items():
        (staging / file_name).write_text(text, encoding="utf-8")
    old = root / f".{name}.{os.getpid()}.old"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target
