"""The SGLang-compatible language: primitives, programs, program states."""
