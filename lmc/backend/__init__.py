"""Backends: where a program's gens and selects go. `Local` runs the in-process engine."""
