"""The chaos soak: sustained mixed traffic through a sandbox's load balancer while faults
land at random moments, every request judged against the same prompt's answer on the
quiet cluster, every page judged by the ledger (Jepsen's shape: load, faults, then each
operation checked against a model).

plan (what to send and inject, drawn from a seed) -> catalogue (the prompts and their
quiet answers) -> traffic (one request of a kind) and faults (one fault) -> judge (one
request's verdict) -> run (clients, injector, end checks) -> report (table and JSON).
"""
