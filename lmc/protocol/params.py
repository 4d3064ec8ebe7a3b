"""Sampling parameters and images: what a gen asks a backend for (imports nothing of lmc)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL, str: REGEX_STR}


@dataclass
class GenParams:
    """Sampling options of one gen; None means "inherit the program-level value from run()"."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    dtype: type | None = None

    def merged_over(self, defaults: "GenParams") -> "GenParams":
        """This gen's values where set, the program's defaults elsewhere."""
        return replace(defaults, **{f.name: getattr(self, f.name) for f in fields(self)
                                    if getattr(self, f.name) is not None})

    def engine_params(self) -> dict[str, Any]:
        """The engine's sampling dict (SGLang's defaults for what is still unset)."""
        p = {f.name: getattr(self, f.name) for f in fields(self)
             if getattr(self, f.name) is not None and f.name not in ("n", "dtype")}
        if self.dtype is not None and self.regex is None and self.json_schema is None:
            p["regex"] = _DTYPE_REGEX[self.dtype]
        p.setdefault("max_new_tokens", 128)
        return p


# Program-level defaults, as SGLang's run(): every field set.
DEFAULT_PARAMS = GenParams(max_new_tokens=128, min_new_tokens=0, n=1, stop=None, stop_token_ids=None,
                           temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, frequency_penalty=0.0,
                           presence_penalty=0.0, ignore_eos=False)



@dataclass(eq=False)
class Image:
    """An encoded image file (PNG/JPEG) in a program's state; API backends send it as vision content."""
    data: bytes
    mime: str = "image/png"
