"""Code that patched SGLang imports at run time.

Upstream files carry thin seams that call into this package, so the
hardening logic is written and tested once, whatever the base release.
Nothing here may import SGLang at module level: a seam is called from
inside SGLang's own import graph.
"""

# Upstream's PD warm-up requests carry this bootstrap host: no peer, no transfer.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
