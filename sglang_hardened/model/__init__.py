"""An explicit-state model of the PD KV page and transfer protocol.

Upstream's fixes for the over-pool incident came one at a time; this model
says which interleavings of admission, allocation, transfer, abort, ack,
timeout and crash can put another tenant's page in front of decode, and
which hardening items (those `configs.Switch` names) close them. It is pure Python, checked
exhaustively within stated bounds, so CI can run it anywhere.

Modules: ``state`` (the immutable state and the workload), ``machine``
(the transitions), ``properties`` (safety predicates and liveness goals),
``checker`` (breadth-first search and liveness), ``configs`` (switches,
named configurations, scenarios), ``report`` (traces and tables), ``cli``.
"""
