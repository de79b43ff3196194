#!/usr/bin/env bash
# A virtual environment with PyTorch 2.x from PyPI, for the CPU comparison in docs/results/cpu.md:
#
#   bench/setup-torch-venv.sh            # -> bench/.venv-torch (git-ignored)
#   bench/.venv-torch/bin/python bench/torch_gpt2.py --device cpu ...
#
# Not scripts/setup: headroom builds and tests without PyTorch; only this comparison needs it.
# PyTorch's own CPU-only index is tried first (a ~200 MB wheel); where it cannot be reached, the
# wheel from PyPI (the CUDA build, which runs on a CPU too, with its CUDA libraries as
# dependencies: several GB). Set TORCH_SPEC to pin a version (default: the newest 2.x).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${VENV:-$here/.venv-torch}"
spec="${TORCH_SPEC:-torch>=2,<3}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
if "$venv/bin/python" -m pip install -q "$spec" --index-url https://download.pytorch.org/whl/cpu \
    2>/dev/null; then
  echo "setup-torch-venv: installed $spec from PyTorch's CPU index"
else
  echo "setup-torch-venv: PyTorch's CPU index unreachable; installing $spec from PyPI" >&2
  "$venv/bin/python" -m pip install -q "$spec"
fi
# numpy: torch warns without it at import. torch.compile's CPU backend (inductor) compiles C++
# with the system's g++ at run time.
"$venv/bin/python" -m pip install -q numpy
"$venv/bin/python" - <<'PY'
import torch
print("setup-torch-venv: torch", torch.__version__, "threads", torch.get_num_threads(),
      "mkldnn", torch.backends.mkldnn.is_available(),
      "cpu capability", torch.backends.cpu.get_cpu_capability())
PY
