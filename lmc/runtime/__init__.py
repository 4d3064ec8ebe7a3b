"""lmc's local runtime: a radix-cache inference engine (imports torch; `import lmc` does not import this)."""
from .core import RequestError, SamplingParams
from .engine import Engine
from .model.loader import UnknownModelError, known_models

__all__ = ["Engine", "SamplingParams", "RequestError", "UnknownModelError", "known_models"]
