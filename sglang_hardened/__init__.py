"""sglang-hardened: hardened SGLang builds and the runtime layer their patches call."""

__version__ = "0.1.0"
