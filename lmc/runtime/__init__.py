"""lmc's local runtime: a radix-cache inference engine (imports torch; `import lmc` does not import this)."""
from .core import EngineError, RequestError, SamplingParams
from .engine import Engine
from .model.loader import UnknownModelError, known_models

__all__ = ["Engine", "SamplingParams", "RequestError", "EngineError", "UnknownModelError", "known_models"]
