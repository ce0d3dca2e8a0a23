#!/usr/bin/env bash
# vLLM's fuser detection vs fusion.plan over the corpus, in a venv of its own (the same
# install as `tox -e vllm-peer`, pinned by constraints/vllm-peer.txt: vLLM 0.34.0 on
# Transformers 5.22.2, the newest line it accepts):
#
#     scripts/vllm_peer.sh [--arch GLOB ...] [--json FILE]     # python -m harness.peers.vllm
#
# Another pinned release: VLLM_PEER_CONSTRAINTS names its constraints file, which pins vLLM and
# Transformers (0.33.0, the previous peer: VLLM_PEER_CONSTRAINTS=constraints/vllm-peer-0.33.txt;
# its venv is then .venv-vllm-<file stem>). Creates the venv at $VLLM_PEER_VENV (default
# .venv-vllm in the checkout) on first use, about 3 GB and 8 minutes; reuses it while the
# constraints and this script's package list are unchanged (a stamp in the venv). The CPU
# torch build is installed first: pip finds it where a local wheel directory or index offers
# it; elsewhere set VLLM_PEER_TORCH_INDEX (e.g. the PyTorch CPU index URL), or pip pulls the
# CUDA build. Runs under `nice -n 19`: detection is single-process and light, but it shares
# the machine. Exit status: the command's (0 every disagreement classified, 1 one is not, 2
# usage or vLLM not importable).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONSTRAINTS="$(realpath "${VLLM_PEER_CONSTRAINTS:-$ROOT/constraints/vllm-peer.txt}")"
if [[ -n "${VLLM_PEER_CONSTRAINTS:-}" ]]; then
    DEFAULT_VENV="$ROOT/.venv-vllm-$(basename "$CONSTRAINTS" .txt)"
else
    DEFAULT_VENV="$ROOT/.venv-vllm"
fi
VENV="${VLLM_PEER_VENV:-$DEFAULT_VENV}"

# What `import vllm` and its Transformers-backend fusers need (vLLM itself goes in with
# --no-deps); tox.ini's [testenv:vllm-peer] lists the same (tests/harness/peers/test_vllm_peer.py).
# Versions, vLLM's and Transformers' included, come from the constraints file alone.
PEER_DEPS=(
    transformers
    aiohttp cachetools cbor2 cloudpickle einops fastapi llguidance msgspec openai
    openai-harmony partial-json-parser pillow prometheus-client psutil py-cpuinfo pybase64
    pyzmq requests urllib3 uvloop xgrammar
)

stamp="$( { cat "$CONSTRAINTS" "${BASH_SOURCE[0]}"; } | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$VENV/.vllm-peer-stamp" || "$(cat "$VENV/.vllm-peer-stamp")" != "$stamp" ]]; then
    echo "vllm-peer: installing into $VENV (first use: ~3 GB, minutes)" >&2
    python3 -m venv "$VENV"
    export PIP_CONSTRAINT="$CONSTRAINTS"
    pip=("$VENV/bin/python" -m pip install -q)
    "${pip[@]}" torch==2.13.0 ${VLLM_PEER_TORCH_INDEX:+--index-url "$VLLM_PEER_TORCH_INDEX"}
    "${pip[@]}" "${PEER_DEPS[@]}"
    "${pip[@]}" --no-deps vllm
    "${pip[@]}" --no-deps -e "$ROOT"
    echo "$stamp" > "$VENV/.vllm-peer-stamp"
fi

cd "$ROOT"
export VLLM_TARGET_DEVICE=cpu
exec nice -n 19 "$VENV/bin/python" -m harness.peers.vllm "$@"
