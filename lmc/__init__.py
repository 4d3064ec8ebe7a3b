"""lmc: an optimizing compiler and runtime for LM programs.

SGLang programs run unchanged with `import lmc as sgl`. Importing lmc needs no torch: the local runtime is
imported when a `Local` backend is created, the `openai` client when an `OpenAI` backend makes its first call.
"""
from .backend.endpoint import RuntimeEndpoint
from .backend.local import Local
from .backend.openai import OpenAI, Usage, program_usage, total_usage
from .frontend.primitives import (REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, assistant, assistant_begin,
                                  assistant_end, gen, gen_int, gen_string, image, select, system, system_begin,
                                  system_end, unordered, user, user_begin, user_end)
from .frontend.program import (BatchAborted, Program, flush_cache, function, get_default_backend,
                               set_default_backend)
from .frontend.state import ProgramState, ProgramStateGroup
from . import compiler  # noqa: F401,E402 (registers Program.compile's implementation)
from .protocol import (ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection, token_length_normalized,
                       unconditional_likelihood_normalized)

__version__ = "0.1.0"

__all__ = [
    "Local", "RuntimeEndpoint", "OpenAI", "Usage", "program_usage", "total_usage", "function", "Program",
    "ProgramState", "ProgramStateGroup", "gen", "gen_int", "gen_string", "select",
    "image", "unordered", "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend", "flush_cache",
    "BatchAborted", "ChoicesDecision", "ChoicesSamplingMethod", "token_length_normalized", "greedy_token_selection",
    "unconditional_likelihood_normalized", "REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR",
]
