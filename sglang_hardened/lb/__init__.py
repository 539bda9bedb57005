"""`sglang-hardened lb`: the distribution's prefill/decode load balancer (H9).

Same request protocol as sglang-router's mini-lb (bootstrap host, port and
room injected; prefill and decode called together), with two differences an
operator can see: the client gets the first non-2xx of either role with its
body (mini-lb returns decode's status, so a prefill 400 waits out decode's
timeout), and neither a client disconnect nor a timeout closes a worker
connection while a KV transfer into decode's pages may still be running.

Modules: ``config`` (what the operator sets), ``workers`` (health checks),
``routing`` (policies and the entry-point hook), ``protocol`` (request
checks and the fields the LB injects), ``exchange`` (one request's pair of
worker calls and the abort rules), ``slots`` (what ``--max-requests``
counts), ``offload`` (large JSON work off the event loop), ``server`` (HTTP
app, drain on SIGTERM).
"""
