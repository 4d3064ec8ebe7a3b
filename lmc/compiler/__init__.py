"""The compiler: tracing programs into segments (trace), the passes' driver and the compiled program
(compiled), the plan executor (executor), and the interpreter fallback for what cannot be resumed (interpret)."""
