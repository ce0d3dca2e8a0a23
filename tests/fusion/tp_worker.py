"""One rank of the tensor-parallel check (tests/fusion/engine/test_placement.py), run by torchrun.

    torchrun --nproc-per-node 2 tests/fusion/tp_worker.py MODEL_DIR OUT.pt

Loads the saved model with `tp_plan="auto"` (gloo on CPU; weights become DTensors), runs it,
fuses it, runs it again on the same ids; rank 0 saves both logits and the fusion report's
counts and refusal reasons.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import fusion

IDS = torch.tensor([[5, 7, 11, 13, 17, 19, 23], [29, 31, 37, 41, 43, 47, 53]])


def main(model_dir: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        unfused = model(IDS).logits
    report = fusion.fuse(model, backend="torch")
    with torch.no_grad():
        fused = model(IDS).logits
    if dist.get_rank() == 0:
        torch.save(
            {
                "unfused": unfused,
                "fused": fused,
                "applied": dict(report.counts()),
                "reasons": sorted({s.reason for s in report.skipped}),
                "param_type": type(model.model.layers[0].self_attn.o_proj.weight).__name__,
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
