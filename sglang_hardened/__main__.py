"""`python -m sglang_hardened` runs the CLI (handy where the script is not on PATH)."""

from .cli import main

main()
