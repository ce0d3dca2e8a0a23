"""Peer systems: other fusion engines whose decisions are compared with ours, module by module.

- `agreement`: the comparison itself, with no peer imported: decisions, the per-family
  agreement table, every disagreement classified, the JSON report.
- `vllm`: vLLM's Transformers-backend fuser detection (imported lazily, from a separate
  environment: `scripts/vllm_peer.sh`, `tox -e vllm-peer`) against `fusion.plan` over the
  corpus; `python -m harness.peers.vllm`.
- `vllm_tests`: vLLM's own fuser unit tests (from its sdist) run against our engine,
  `python -m harness.peers.vllm_tests`; `vllm_mapping` is the pytest plugin and stand-in
  `vllm` package they run under (loaded only into that subprocess).
- `hazards`: repro bundles of the vLLM rewrites our analysis refuses as unsafe,
  `python -m harness.peers.hazards DIR`.
- `liger_apply`: Liger Kernel's own per-type patch applied to a built model, its global
  patches scoped to that model (`liger_globals`), its kernel launches counted
  (`triton_launches`): the `liger` system. `liger_repro` writes its failures' standalone
  replays, `liger_findings` tables and classifies its results.
- `triton_interpreter`: the gaps of Triton's interpreter handled in one place, for systems
  whose Triton kernels run on a CPU.
"""
