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

# --no-compile, then one parallel byte-compile of site-packages below: pip compiles
# each package's modules on one core (torch alone: 45 s, against 13 s + 21 s).
pip_install() { python -m pip install -q --no-compile "$@"; }
# torch first and pinned: it is taken from a local file here; an unpinned torch
# (or one pulled in by executorch) would download a multi-GB CUDA build.
if ! python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    pip_install "torch==2.13.0"
fi
pip_install -e '.[dev]'
# Test dependency: only CUDA wheels of torchvision 0.28.0 (paired with torch 2.13.0) are
# served; --no-deps keeps the CPU torch. Its C ops do not load;
# qnn_convbwd/torchvision_import.py copes.
pip_install --no-deps torchvision==0.28.0
site=$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# compileall exits non-zero when any module fails to compile; pip ignores those as well
python -m compileall -q -j 0 "$site" > /dev/null || echo "setup: some modules did not byte-compile"

# Assemble the SDK root from the onnxruntime-qnn wheel and build (or reuse) the shim;
# same as `qnn-convbwd doctor --sdk-only`, without importing the other subcommands.
python -m qnn_convbwd.toolchain.doctor --sdk-only
