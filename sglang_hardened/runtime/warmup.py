"""Upstream's PD warm-up requests: they name this bootstrap host, so no peer, no transfer,
and no hardened check may refuse or follow them."""

FAKE_BOOTSTRAP_HOST = "2.2.2.2"
