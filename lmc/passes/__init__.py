"""Optimisation passes over a ProgramGraph. Each is a function graph -> (plan decisions, report numbers)."""
from .prefix_hoist import constant_prefix, fork_commit_texts

__all__ = ["constant_prefix", "fork_commit_texts"]
