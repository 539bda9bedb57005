"""CPU stand-in for sgl_kernel: its CPU build is not on the package index.

Why: SGLang imports kernel names at module level; on these AVX2-only CPUs
(no AMX) the Llama layers use native torch, so a call here is a bug and says so.
"""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: CPU stand-in has no kernel")

    missing.__name__ = name
    return missing
