"""The oracles: what decides that a fused model computes what the unfused one does.

    parity      tolerance rule, error measure, masking, NaN (pure functions)
    ties        near-tie top-k choices (MoE routing) no parity verdict can hold a system to
    localise    per-module verdicts: which fused module changed the function
    warned      warnings raised in a block, as comparable lines
    lifecycle/  lifecycle parity: generate, training step, save/load, weight edits, compile

May import: harness.base, fusion's public API (fusion, fusion.inspection, fusion.errors,
fusion.report, fusion.numerics, fusion.kernels).
"""
