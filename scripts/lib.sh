# Sourced by the scripts here: one place that sets up the project's venv.
# The venv lives in the checkout (.venv, ignored); downloads and built
# environments live in the user's cache (~/.cache/sglang-hardened).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

# ensure_venv [EXTRA]: create .venv with python3 >= 3.11 and install the tool editable.
ensure_venv() {
    local spec="$ROOT${1:+[$1]}"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "setting up $VENV" >&2
        python3 -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$spec"
}
