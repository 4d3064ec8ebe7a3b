"""lmc: an optimizing compiler and runtime for LM programs.

The local runtime lives in `lmc.runtime` and is imported lazily, so that `import lmc` needs no torch.
"""
__version__ = "0.1.0"
