"""ProgramLedger: what the scheduler knows about the program instances its requests belong to (issue 14).

Requests carry ProgramHints (lmc.protocol.hints) when a compiled plan made them. The ledger keeps, per instance:
- `attained`: the tokens the instance has generated so far (its finished and retracted requests' outputs; the unit
  of the hints' `tokens_left`), the least-attained-service estimate where the plan cannot bound the work;
- `steps`: how many of its requests have let go of their KV (finished, or retracted: each counted once when it
  finishes), the clock the hints' `next_use` is measured on;
- `live`: its requests seen waiting and not finished yet, and whether its last finished request ended the plan
  (`calls_left == 1` and no `next_use`): with nothing live after that, the instance is finished.
It also remembers when each waiting request was first seen (the program policy's aging).

KV retention (`eviction_key`, used by the radix tree's eviction while the program policy schedules): when a hinted
request finishes, the tree node ending at its computed tokens is tagged with a Retain (its instance and the step of
its next use). Leaves are then evicted in three classes, least recently used first within each:
  0. prefixes of finished instances, and prefixes the plan says nothing will extend (no `next_use`);
  1. untagged prefixes (requests without hints, shared headers), tags whose next use has passed, and tags of
     instances idle for more than `retain_s` seconds (a client that went away does not pin its KV forever);
  2. prefixes with a known next use, the furthest next use first.
Hints never change what a request computes, only what is kept and what runs first.
"""
from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ..core import Req

MAX_INSTANCES = 65536  # instances remembered (least recently active forgotten first): bounds the ledger's memory


@dataclass(eq=False)
class InstanceState:
    attained: int = 0
    steps: int = 0
    live: set = field(default_factory=set)  # rids of its requests seen and not finished
    ended_plan: bool = False  # its last finished request was the plan's last call
    last_active: float = 0.0
    arrived: float = 0.0  # when its first request was seen (the program policy ages instances from here)

    @property
    def finished(self) -> bool:
        return self.ended_plan and not self.live


@dataclass(frozen=True, eq=False)
class Retain:
    """A tree node's retention tag: whose prefix it is and at which of the instance's steps it is used next."""

    state: InstanceState
    due: int | None  # the instance's `steps` value at which its next use is admitted; None: no known next use


class ProgramLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic, retain_s: float = 60.0):
        self.clock, self.retain_s = clock, retain_s
        self.instances: OrderedDict[str, InstanceState] = OrderedDict()
        self.first_seen: weakref.WeakKeyDictionary[Req, float] = weakref.WeakKeyDictionary()
        self._counted: weakref.WeakKeyDictionary[Req, int] = weakref.WeakKeyDictionary()
        self.retaining = False  # set by the policy each time it orders: eviction follows the tags only then

    def state(self, instance: str) -> InstanceState:
        st = self.instances.get(instance)
        if st is None:
            st = self.instances[instance] = InstanceState(arrived=self.clock())
            if len(self.instances) > MAX_INSTANCES:
                self.instances.popitem(last=False)
        else:
            self.instances.move_to_end(instance)
        st.last_active = self.clock()
        return st

    def seen(self, r: Req) -> float:
        """Note that r is waiting; returns when it was first seen waiting."""
        t = self.first_seen.get(r)
        if t is None:
            t = self.first_seen[r] = self.clock()
            if r.program is not None:
                self.state(r.program.instance).live.add(r.rid)
        return t

    def age(self, r: Req, now: float) -> float:
        """Seconds since r's instance arrived (since r was first seen, for a request without hints)."""
        st = self.instances.get(r.program.instance) if r.program is not None else None
        return now - (st.arrived if st is not None else self.first_seen.get(r, now))

    def attained(self, r: Req) -> int:
        st = self.instances.get(r.program.instance) if r.program is not None else None
        return st.attained if st is not None else 0

    def released(self, r: Req) -> InstanceState | None:
        """r let go of its KV (finished, aborted, retracted): count its new output tokens as the instance's
        service, and when r is finished, its step and whether it ended the plan. Returns its instance's state."""
        if r.program is None:
            return None
        h = r.program
        st = self.state(h.instance)
        n = len(r.output_ids)
        st.attained += n - self._counted.get(r, 0)
        self._counted[r] = n
        if r.finished:
            st.steps += 1
            st.live.discard(r.rid)
            st.ended_plan = h.calls_left == 1 and h.next_use is None
            if st.finished:
                self.instances.pop(h.instance, None)  # tags keep the state object; the id may be reused
        return st

    def tag(self, r: Req, st: InstanceState) -> Retain:
        """The retention tag of finished request r's prefix (call after `released`)."""
        nu = r.program.next_use
        return Retain(st, None if nu is None else st.steps + nu - 1)

    def eviction_key(self, node) -> tuple:
        """Sort key of an evictable leaf (smallest evicted first; the tree breaks ties least recently used
        first): the classes of the module docstring."""
        tag = node.retain
        if tag is None:
            return (1, 0)
        st = tag.state
        if st.finished or tag.due is None:
            return (0, 0)
        distance = tag.due - st.steps
        if distance < 0 or self.clock() - st.last_active > self.retain_s:
            return (1, 0)
        return (2, -distance)
