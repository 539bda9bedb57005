"""Host-device synchronisations on the scheduler thread (test instrumentation).

On a GPU the scheduler thread stalls wherever it asks for a value the device computes: a
tensor's value read on the host (``.item()``, ``int()``/``bool()`` of a tensor: the op
``_local_scalar_dense``), ``torch.equal``, an op whose output size depends on the data
(``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without its size), and a
copy to the host (``.cpu()``, ``.tolist()``, ``.numpy()``). On CPU none of these waits for
anything, so the sandbox can count them but not time them: with ``SANDBOX_SYNCS_DIR`` set,
the scheduler's loop runs under a torch dispatch mode (``counting``, applied by the overlay's
edit to ``run_scheduler_process``, on upstream and hardened builds alike), which counts each
such call made on that thread, and the copies through the tensor methods that do not dispatch.

Each count is keyed by what made it: the outermost frame of the hardened runtime
(``sglang_hardened.runtime``) on the stack, as ``module.function`` (a seam), else
``upstream``; and by its site (the innermost frame outside torch and this file, ``file:line``).
Every tensor here is on the CPU, including those a GPU node keeps on the host too (SGLang's
metadata buffers, its page tables' host copies), so the counts bound from above what would
synchronise on a GPU; the sites say which are which. Each process writes its totals to
``<dir>/<pid>.json`` every ``WRITE_EVERY_S`` and at exit, with the time it wrote them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import sys
import threading
import time

DIR_ENV = "SANDBOX_SYNCS_DIR"
WRITE_EVERY_S = 0.5
RUNTIME = "sglang_hardened.runtime."
FORWARD = ("model_executor", "layers")  # SGLang's model execution, under sglang/srt/
HARNESS = "sgl_"  # this overlay's modules (their sites are their file names)
# aten overload packets that make the host wait for the device on CUDA
SYNC_OPS = {"equal": "equal", "_local_scalar_dense": "item", "nonzero": "nonzero", "masked_select": "nonzero",
            "unique": "nonzero", "_unique": "nonzero", "_unique2": "nonzero", "unique_dim": "nonzero",
            "unique_consecutive": "nonzero", "repeat_interleave": "nonzero"}
COPY_METHODS = ("cpu", "tolist", "numpy")  # tensor methods that read a device tensor on the host
_HERE = os.path.abspath(__file__)

_counts: dict[tuple[str, str, str], int] = {}  # (kind, owner, site) -> calls
_on = threading.local()  # ``active``: this thread is counted


def _origin() -> tuple[str, str]:
    """(owner, site) of the call being counted. The owner: the outermost hardened runtime frame
    on the stack as ``module.function`` (a seam); else ``harness`` when the site is this
    overlay's own instrumentation (``sgl_*``: it runs on upstream and hardened alike, and not in
    production); else ``upstream forward`` under SGLang's model execution (``model_executor/``,
    ``layers/``: on a GPU, other kernels and CUDA graphs, not this CPU path); else ``upstream``.
    The site: the innermost frame outside torch and this file."""
    owner, site, forward = None, "?", False
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        path = frame.f_code.co_filename
        if site == "?" and not name.startswith("torch") and os.path.abspath(path) != _HERE:
            site = f"{_short(path)}:{frame.f_lineno}"
        if name.startswith(RUNTIME):
            owner = f"{name[len(RUNTIME):]}.{frame.f_code.co_name}"
        forward = forward or any(f"sglang/srt/{part}/" in path for part in FORWARD)
        frame = frame.f_back
    if owner is None:
        owner = "harness" if site.startswith(HARNESS) else "upstream forward" if forward else "upstream"
    return owner, site


def _short(path: str) -> str:
    """A site's file from its package down (``sglang/srt/...``), not the environment's path."""
    for root in ("sglang_hardened/", "sglang/"):
        if root in path:
            return root + path.split(root, 1)[1]
    return os.path.basename(path)


def _count(kind: str) -> None:
    key = (kind, *_origin())
    _counts[key] = _counts.get(key, 0) + 1


def _mode():
    """A dispatch mode counting SYNC_OPS (made lazily: importing this file needs no torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = SYNC_OPS.get(func._overloadpacket.__name__)
            if kind is not None:
                _count(kind)
            return func(*args, **(kwargs or {}))

    return Counting()


@contextlib.contextmanager
def counted():
    """Count this thread's syncs while inside: the dispatch mode, and the copy methods wrapped
    (for every thread, counting only those inside), put back on the way out."""
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in COPY_METHODS}

    def wrapped(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            if getattr(_on, "active", False):
                _count("copy")
            return method(self, *args, **kwargs)
        return wrapper

    for name, method in originals.items():
        setattr(torch.Tensor, name, wrapped(method))
    _on.active = True
    try:
        with _mode():
            yield
    finally:
        _on.active = False
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def snapshot() -> dict:
    return {"pid": os.getpid(), "written_at": time.time(),
            "title": open("/proc/self/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace"),
            "counts": [{"kind": k, "owner": o, "site": s, "calls": n} for (k, o, s), n in sorted(dict(_counts).items())]}


def _write(folder: str) -> None:
    path = os.path.join(folder, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(snapshot(), out)
    os.replace(path + ".tmp", path)


def _writer(folder: str) -> None:
    while True:
        _write(folder)
        time.sleep(WRITE_EVERY_S)


def counting(loop):
    """``loop`` (the scheduler's event loop), run with this thread's syncs counted when
    ``DIR_ENV`` is set; ``loop`` itself otherwise."""
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return loop

    @functools.wraps(loop)
    def counted_loop(*args, **kwargs):
        threading.Thread(target=_writer, args=(folder,), name="sandbox-syncs", daemon=True).start()
        atexit.register(_write, folder)
        with counted():
            return loop(*args, **kwargs)

    return counted_loop
