"""Stand-in: Triton compiles GPU kernels, which only the real CUDA base image can run.

`import sglang` imports it (sglang/srt/utils/common.py) and sets one
attribute on it; nothing else touches it until a kernel is compiled.
"""
