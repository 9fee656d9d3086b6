#!/usr/bin/env bash
# Runs routelog's megatron-core tests against the newest megatron-core, which needs Python 3.12 (0.16.1, the newest
# for Python 3.11, is what CI tests). Not part of .ci/run: torch for Python 3.12 is only published as a CUDA build
# (several GB; it runs on the CPU).
#
#   tools/test_megatron_versions.sh [VENV_DIR] [MEGATRON_CORE_VERSION]
#
# Defaults: /tmp/routelog-py312 and megatron-core 0.19.2. Needs a Python 3.12 interpreter (pyenv, or PYTHON312=path).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/routelog-py312}
version=${2:-0.19.2}
python=${PYTHON312:-$(command -v python3.12 || echo "$HOME/.pyenv/versions/3.12.1/bin/python")}
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/pip" install -q "torch==2.13.0" "megatron-core==$version" pytest hypothesis -e ".[s3]"
"$venv/bin/python" -c "import megatron.core, sys; print('megatron-core', megatron.core.__version__, 'python', sys.version.split()[0])"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_megatron.py tests/test_align.py tests/test_loader.py
