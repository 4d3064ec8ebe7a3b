"""The compiler: tracing programs into segments (trace), the passes' driver and the compiled program
(compiled), the plan executor (executor), and the interpreter fallback for what cannot be resumed (interpret)."""
from ..frontend.program import register_compiler
from .compiled import CompiledProgram

register_compiler(CompiledProgram)

__all__ = ["CompiledProgram"]
