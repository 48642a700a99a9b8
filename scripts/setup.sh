#!/usr/bin/env bash
# One command for a fresh machine: .venv with torch 2.13.0 (CPU), the package with
# its dev extras (executorch 1.5.1, onnxruntime-qnn 2.7.0), then the QNN SDK root
# and the HTP shim in ~/.cache/qnn_convbwd (or $QNN_CONVBWD_CACHE). Idempotent:
# a second run reuses the venv, finds everything installed and the shim cached.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

# --no-compile: pip would byte-compile every module of torch and executorch (most of
# that time goes to modules nothing imports); Python compiles what is imported, once.
pip_install() { python -m pip install -q --no-compile "$@"; }
# torch first and pinned: it is taken from a local file here; an unpinned torch
# (or one pulled in by executorch) would download a multi-GB CUDA build.
if ! python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    pip_install "torch==2.13.0"
fi
pip_install -e '.[dev]'
# Test dependency: only CUDA wheels of torchvision 0.28.0 (paired with torch 2.13.0) are
# served; --no-deps keeps the CPU torch. Its C ops do not load; tests/zoo.py copes.
pip_install --no-deps torchvision==0.28.0
# Byte-compile what a lowering imports now, in one process, rather than in every test
# worker at once (torchao's optional CUDA kernels print load failures: shown on error only).
warm='import qnn_convbwd, executorch.exir, executorch.backends.qualcomm.partition.qnn_partitioner'
if ! out=$(python -c "$warm" 2>&1); then
    echo "$out" >&2
    exit 1
fi

# Assemble the SDK root from the onnxruntime-qnn wheel and build (or reuse) the shim;
# same as `qnn-convbwd doctor --sdk-only`, without importing the other subcommands.
python -m qnn_convbwd.toolchain.doctor --sdk-only
