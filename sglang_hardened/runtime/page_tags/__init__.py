"""H8, page ownership tags: every KV page decode reads carries the tag of the request reading it.

``rows`` holds the tag rows and the check against them; ``seams`` adapts SGLang's PD objects
(Mooncake) to them and ``nixl`` does so for NIXL; ``cost`` times the tag operations in the
server; ``switch`` reads whether a server tags pages. Nothing is imported here: ``switch`` is
read torch-free (preflight, the CLI), and ``rows`` needs torch.
"""
