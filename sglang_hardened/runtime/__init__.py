"""Code that patched SGLang imports at run time.

Upstream files carry thin seams that call into this package, so the
hardening logic is written and tested once, whatever the base release.
Nothing here may import SGLang at module level: a seam is called from
inside SGLang's own import graph.
"""

from . import seam_cost as _seam_cost

_seam_cost.install()  # times every seam only while its switch names a directory (off by default)
