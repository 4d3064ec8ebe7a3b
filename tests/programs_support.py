"""The programs and instruments shared by tests/test_programs_api.py and benchmarks/programs_bench.py: the chain
of 6 short gens and selects (the issue's static workload), small forked programs, and test doubles counting
HTTP requests on either side of the wire."""
from __future__ import annotations

import json

import lmc
from lmc.backend.endpoint import RuntimeEndpoint


@lmc.function
def chain(s, topic):
    """A chain of 6 short gens and selects: gen, select, gen, select, gen, select (no graph break)."""
    s += "Topic: " + topic + "\n"
    for i in range(3):
        s += f"Fact {i + 1}:" + lmc.gen(f"fact{i}", max_tokens=6, stop="\n") + "\n"
        s += "Is it true? " + lmc.select(f"true{i}", choices=["yes", "no"]) + "\n"


@lmc.function
def forked(s, topic):
    s += "Topic: " + topic + "\n"
    forks = s.fork(2)
    for k, f in enumerate(forks):
        f += f"Idea {k}:" + lmc.gen("idea", max_tokens=6, stop="\n")
    forks.join()
    s += "Best idea:" + lmc.gen("best", max_tokens=6, stop="\n")


@lmc.function
def forked_after_gen(s, topic):
    """A fork after a gen: on lmc's engine its branches are child requests of the chain's (engine-side forks)."""
    s += "Topic: " + topic + "\nFact:" + lmc.gen("fact", max_tokens=6, stop="\n") + "\n"
    forks = s.fork(2)
    for k, f in enumerate(forks):
        f += f"Idea {k}:" + lmc.gen("idea", max_tokens=6, stop="\n")
    forks.join()
    s += "Best idea:" + lmc.gen("best", max_tokens=6, stop="\n")


class CountingApp:
    """Test double: an ASGI wrapper that records each HTTP request's path (and its JSON body, in `bodies`) and
    answers 404 for `missing` paths (a server without those routes)."""

    def __init__(self, app, missing=()):
        self.app, self.missing, self.paths, self.bodies = app, set(missing), [], []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.paths.append(scope["path"])
            if scope["path"] in self.missing:
                await send({"type": "http.response.start", "status": 404,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": b'{"error": {"message": "Not Found"}}'})
                return
            messages, raw = [], b""
            while True:
                m = await receive()
                messages.append(m)
                raw += m.get("body", b"")
                if m["type"] != "http.request" or not m.get("more_body"):
                    break
            self.bodies.append((scope["path"], json.loads(raw) if raw else None))
            replay = iter(messages)

            async def receive_again():
                return next(replay, None) or await receive()

            await self.app(scope, receive_again, send)
            return
        await self.app(scope, receive, send)


class CountedEndpoint(RuntimeEndpoint):
    """Test double: a RuntimeEndpoint counting the HTTP requests it sends (for a server in another process, where
    no CountingApp can sit)."""

    requests = 0

    def _client(self):
        c = super()._client()
        if not getattr(c, "_counted", False):
            async def count(request):
                type(self).requests += 1
            c.event_hooks = {"request": [count], "response": []}
            c._counted = True
        return c
