"""Standalone repro bundles of Liger findings: replayable with torch, transformers and
liger-kernel (with its triton) only, no fusion-harness.

`harness.runner.repro` writes every failure's bundle (bundle.json, replayed by `fusion-harness
repro`); for a failure of the `liger` system, `write_standalone(directory, fields)` adds what a
Liger developer needs without this package:

    repro_liger.py               rebuilds the tiny model, computes the unpatched references
                                 first, applies Liger, checks the finding; exit 1 if it
                                 reproduces, 0 if not, 2 if the kind cannot be replayed alone
    weights.safetensors          the model's exact weights (the corpus's seeded ones), so the
                                 replay is bit for bit the harness's model
    inputs.json                  the forward inputs
    triton_interpreter_shims.py  a copy of `harness.peers.triton_interpreter` (it imports
                                 nothing of this package): Triton 3.9's interpreter gaps,
                                 handled as the harness handles them, where no GPU is present

Replayed standalone: forward errors (of the model, or of a replaced module it calls), fused-only
warnings, logits parity and greedy `generate` differences; other kinds say so and exit 2
(`fusion-harness repro` replays them).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model

import corpus
from harness.peers import triton_interpreter

SCRIPT = "repro_liger.py"
SHIMS = "triton_interpreter_shims.py"


def write_standalone(directory: Path, fields: dict[str, Any]) -> list[str]:
    """Write the standalone files for the bundle `fields` (bundle.json's content) into
    `directory`, rebuilding the model from its config and seed; returns their names. Safe:
    it writes only into `directory`, and the weights are the corpus's own seeded draw."""
    config = corpus.config_from_dict(fields["model_type"], fields["config"])
    dtype = getattr(torch, fields["dtype"])
    model = corpus.build_from_config(
        config, seed=fields["seed"], dtype=dtype, device="cpu", name=fields["architecture"]
    )
    inputs = corpus.make_inputs(
        model, seed=fields["seed"], batch=fields["batch"], seq=fields["seq"], device="cpu"
    )
    save_model(model, str(directory / "weights.safetensors"))
    encoded = {
        key: {"dtype": str(value.dtype).removeprefix("torch."), "values": value.tolist()}
        for key, value in inputs.items()
        if isinstance(value, torch.Tensor)
    }
    (directory / "inputs.json").write_text(json.dumps(encoded) + "\n", encoding="utf-8")
    (directory / SHIMS).write_text(inspect.getsource(triton_interpreter), encoding="utf-8")
    script = STANDALONE.replace("{model_class}", type(model).__name__)
    (directory / SCRIPT).write_text(script, encoding="utf-8")
    return [SCRIPT, "weights.safetensors", "inputs.json", SHIMS]


STANDALONE = '''\
"""Standalone replay of a Liger Kernel finding (fusion-harness, system liger).

Needs torch, transformers and liger-kernel (and its triton) only. Rebuilds the tiny model
({model_class}: config in bundle.json, exact weights in weights.safetensors, inputs in
inputs.json), computes the unpatched references FIRST (Liger's apply function patches
Transformers' modeling module for the whole process), then applies Liger's own
apply_liger_kernel_to_<model_type>(model=...) to a copy and checks the finding named in
bundle.json ("kind", "error"). Without a GPU, Liger's Triton kernels run in Triton's
interpreter with triton_interpreter_shims.py (four interpreter gaps handled, as the harness
does). Exit status: 1 if the finding reproduces, 0 if not, 2 if its kind cannot be replayed
standalone (use `fusion-harness repro DIR`).
"""

import copy
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Liger's kernels are imported

import transformers  # noqa: E402
from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_model  # noqa: E402

sys.path.insert(0, str(HERE))
import triton_interpreter_shims  # noqa: E402

BUNDLE = json.loads((HERE / "bundle.json").read_text())
MODEL_CLASS = "{model_class}"


def build():
    config = transformers.CONFIG_MAPPING[BUNDLE["model_type"]].from_dict(BUNDLE["config"])
    model = getattr(transformers, MODEL_CLASS)._from_config(config, dtype=torch.float32)
    weights = str(HERE / "weights.safetensors")
    with safe_open(weights, "pt") as saved:
        dtypes = {name: saved.get_slice(name).get_dtype() for name in saved.keys()}
    table = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in dtypes and tensor.is_floating_point():
            tensor.data = tensor.data.to(table.get(dtypes[name], tensor.dtype))
    load_model(model, weights)
    inputs = json.loads((HERE / "inputs.json").read_text())
    inputs = {k: torch.tensor(v["values"], dtype=getattr(torch, v["dtype"])) for k, v in inputs.items()}
    return model.eval(), inputs


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits.double()


def greedy(model, inputs):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=3, do_sample=False, num_beams=1)


def main():
    kind, error = BUNDLE["kind"], BUNDLE["error"]
    model, inputs = build()
    patched = copy.deepcopy(model)
    reference = copy.deepcopy(model).to(torch.float64)
    if getattr(reference.config, "_experts_implementation", "eager") not in (None, "eager"):
        reference.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    unfused = logits(model, inputs)  # the unpatched references, before any patch
    exact = logits(reference, inputs)
    tokens = greedy(model, inputs) if error.startswith("lifecycle generate") else None
    MODEL_TYPE_TO_APPLY_LIGER_FN[BUNDLE["model_type"]](model=patched)
    with triton_interpreter_shims.shims(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = Capture()
        loggers = [logging.getLogger(), logging.getLogger("transformers")]
        for logger in loggers:
            logger.addHandler(records)
        try:
            fused = logits(patched, inputs)
        except Exception as exc:
            print(f"patched forward raises: {type(exc).__name__}: {exc}")
            if kind == "fused-warning":  # it warned before raising
                return warned(error, caught, records)
            return 1 if kind in ("fused-forward-error", "module-error") else 0
        finally:
            for logger in loggers:
                logger.removeHandler(records)
        if tokens is not None:
            got = greedy(patched, inputs)
            print("unpatched tokens:", tokens.tolist(), "patched:", got.tolist())
            return int(not torch.equal(got, tokens))
    mask = inputs["attention_mask"].bool() if "attention_mask" in inputs else slice(None)
    unfused_err = float((unfused - exact)[mask].abs().max())
    fused_err = float((fused - exact)[mask].abs().max())
    print(f"error vs float64: unpatched {unfused_err:.3g}, patched {fused_err:.3g}")
    if kind == "fused-warning":
        return warned(error, caught, records)
    if kind in ("model-parity", "module-parity"):
        tolerance = float(BUNDLE["tolerance"]) if BUNDLE["tolerance"] is not None else 0.0
        return int(not fused_err <= max(tolerance, 4 * unfused_err))
    print(f"kind {kind} is not replayed standalone: fusion-harness repro {HERE}")
    return 2


def warned(error, caught, records):
    """1 if the patched forward said the warning of `error` ("only the fused model warns:
    Category: text"), else 0."""
    wanted = error.split("warns: ", 1)[-1].split(": ", 1)[-1][:60]
    said = [str(w.message) for w in caught] + records.lines
    print("patched forward warned:", *said, sep="\\n  ")
    return int(any(wanted in line for line in said))


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


if __name__ == "__main__":
    sys.exit(main())
'''
"""The standalone script; `{model_class}` is replaced by the model's class name."""
