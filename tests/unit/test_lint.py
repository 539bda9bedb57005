"""The code passes the linter its configuration in pyproject.toml names (the rule sets it already
passed when they were chosen), so that configuration stays a true description of the code."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import REPO


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           str(REPO)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
