"""POST /v1/programs (placeholder while the split is checked)."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter


@dataclass(frozen=True)
class ProgramLimits:
    max_nodes: int = 4096


def router(svc, limits: ProgramLimits) -> APIRouter:
    return APIRouter()
