"""H8's switch: page tags are on unless a server is started with them off, on purpose.

Off exists to measure what H8 costs end to end (benchmarks/bench_serving_ab.py): the policy
sets it on, a server started with it off logs a warning, and preflight reports the server
unsafe. Torch-free, so preflight and the CLI read it without SGLang's stack.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ...common.knobs import PAGE_TAGS



def tags_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this server tags pages: unless ``PAGE_TAGS.name`` is "off". A value that is neither
    "on" nor "off" is an error that names it: a typo must not turn H8 off."""
    return PAGE_TAGS.get(environ)
