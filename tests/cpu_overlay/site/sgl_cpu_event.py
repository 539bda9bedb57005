"""CPU stand-in for the CUDA event 0.5.23's prefill records after it copies a chunk's page indices
to host memory (its asynchronous branch, which every GPU takes for Mooncake).

On a GPU the copy is non-blocking and the transfer worker waits on the event before it reads the
indices; on CPU the copy is done when ``copy_`` returns, so there is nothing to wait for. The rest
of that branch is upstream's own: the indices travel as a tensor and the worker turns them into an
array before any hardened seam reads them. The first wait says so on stderr (the server's log),
so a test can tell that the branch ran.
"""

import sys

TOOK_BRANCH = "sgl_cpu_event: the transfer worker waited on a chunk's index copy (0.5.23's asynchronous branch)"
_said = False


class Event:
    """What prefill.py and the Mooncake transfer worker call on a ``torch.cuda.Event``."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        global _said
        if not _said:
            _said = True
            print(TOOK_BRANCH, file=sys.stderr, flush=True)
