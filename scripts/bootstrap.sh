#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) with beam-jax and its test/reference extras, once; later calls
# only re-install when pyproject.toml changed. Sourced by scripts/beam-jax and scripts/test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.installed-$(sha1sum "$root/pyproject.toml" | cut -c1-12)"

find_python() {
  # pyenv reads .python-version (3.12.1) in the repo root; otherwise any python3.12+ on PATH.
  for candidate in "python" "python3.13" "python3.12" "python3"; do
    if command -v "$candidate" >/dev/null 2>&1 &&
      (cd "$root" && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))') 2>/dev/null; then
      (cd "$root" && "$candidate" -c 'import sys; print(sys.executable)')
      return
    fi
  done
  echo "beam-jax needs Python >= 3.12 (pyenv: 'pyenv install 3.12')" >&2
  exit 1
}

if [ ! -f "$stamp" ]; then
  [ -x "$venv/bin/python" ] || "$(find_python)" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -e "$root[dev,reference]" >&2
  rm -f "$venv"/.installed-* && touch "$stamp"
fi
