"""The program IR: a dependency DAG over a small node vocabulary, printable and parseable (no torch)."""
from .graph import EDGE_KINDS, NODE_KINDS, IRValidationError, Node, ProgramGraph

__all__ = ["ProgramGraph", "Node", "NODE_KINDS", "EDGE_KINDS", "IRValidationError"]
