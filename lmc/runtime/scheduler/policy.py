"""Admission order of the waiting queue (SGLang's schedule policies).

A policy is an object with `order(waiting, ctx) -> list[Req]`, registered by name in POLICIES. Cache-aware
policies read each request's prefix match (`prefix_slots`, `match_node`), which the scheduler refreshes before
calling them; with the radix cache disabled every policy is FCFS. A new policy (the program-aware one of issue
14) subclasses Policy and registers itself with `register`; `SchedulerConfig.policy` names it.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..core import Req
from ..radix_cache import RadixCache


@dataclass
class PolicyContext:
    """What a policy may look at besides the queue."""

    tree: RadixCache
    rng: random.Random


class Policy(ABC):
    name: str
    cache_aware: bool = False  # reads prefix matches; requests sharing a prefix are also deduplicated in a batch

    @abstractmethod
    def order(self, waiting: list[Req], ctx: PolicyContext) -> list[Req]:
        """The queue in admission order (a new list; the queue itself is left alone)."""


POLICIES: dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
    POLICIES[policy.name] = policy
    return policy


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown schedule policy {name!r}; choose one of {tuple(POLICIES)}") from None


class FCFS(Policy):
    name = "fcfs"

    def order(self, waiting, ctx):
        return list(waiting)


class Random(Policy):
    name = "random"

    def order(self, waiting, ctx):
        q = list(waiting)
        ctx.rng.shuffle(q)
        return q


class LongestPrefixMatch(Policy):
    """Longest cached prefix first (kept on under any load: matching is a few C-level slice compares per edge)."""

    name = "lpm"
    cache_aware = True

    def order(self, waiting, ctx):
        return sorted(waiting, key=lambda r: -len(r.prefix_slots))


class DFSWeight(Policy):
    """Visit the tree heaviest subtree first, so requests sharing a subtree stay adjacent (the paper's DFS order,
    weighted by the number of waiting requests below each node)."""

    name = "dfs-weight"
    cache_aware = True

    def order(self, waiting, ctx):
        at_node: dict = {}
        for r in waiting:
            at_node.setdefault(r.match_node, []).append(r)
        weight: dict = {}
        for node, rs in at_node.items():
            while node is not None:
                weight[node] = weight.get(node, 0) + len(rs)
                node = node.parent
        out: list[Req] = []
        stack = [(ctx.tree.root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(at_node.get(node, ()))
                continue
            stack.append((node, True))
            kids = sorted((c for c in node.children.values() if c in weight), key=lambda c: weight[c])
            stack.extend((c, False) for c in kids)  # heaviest pushed last, visited first
        return out


for _p in (LongestPrefixMatch(), DFSWeight(), FCFS(), Random()):
    register(_p)

