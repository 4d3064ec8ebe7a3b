"""The bottom layer: the types the Backend protocol speaks (sampling parameters, images, chat templates, choice
decisions and methods) and the protocol itself. Imports nothing of lmc, so the frontend, the compiler and the
backends all build on it, and no backend needs the frontend."""
from .backend import NO_CAPABILITIES, Backend, Capabilities, capabilities
from .chat_template import ROLES, ChatTemplate
from .choices import (ChoicesDecision, ChoicesSamplingMethod, decide, greedy_token_selection, token_length_normalized,
                      token_select_prompt, unconditional_likelihood_normalized)
from .params import DEFAULT_PARAMS, REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, GenParams, Image
from .hints import HintsError, ProgramHints, current_hints, instance_id

__all__ = ["Backend", "Capabilities", "NO_CAPABILITIES", "capabilities", "ChatTemplate", "ROLES", "ChoicesDecision",
           "ChoicesSamplingMethod", "decide", "token_length_normalized", "greedy_token_selection",
           "unconditional_likelihood_normalized", "token_select_prompt", "GenParams", "DEFAULT_PARAMS", "Image",
           "REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR", "ProgramHints", "HintsError", "current_hints",
           "instance_id"]
