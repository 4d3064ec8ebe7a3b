"""Test doubles (never used by lmc itself)."""
import asyncio
import contextlib
import time

from lmc.protocol import Capabilities, ChatTemplate, ChoicesDecision


class ScriptedBackend:
    """Answers every gen with a fixed string and every select with its first choice, recording each call."""

    capabilities = Capabilities(images=True)

    def __init__(self, reply: str = "scripted"):
        self.reply, self.calls = reply, []
        self.chat_template = ChatTemplate.plain()

    async def generate(self, text, params, images):
        self.calls.append(("generate", text))
        return self.reply, {"backend": "scripted"}

    async def generate_stream(self, text, params, images):
        self.calls.append(("generate_stream", text))
        yield self.reply, {"backend": "scripted"}

    async def select(self, text, choices, temperature, method):
        self.calls.append(("select", text))
        return ChoicesDecision(choices[0], {})

    async def commit(self, text):
        self.calls.append(("commit", text))

    def flush_cache(self):
        return True


class FaultyForward:
    """Test double for ModelRunner.launch: raises RuntimeError(message) for any batch holding a request that
    `poisoned(req, batch)` selects, else launches the real forward. `raised` counts the failures it injected."""

    def __init__(self, launch, poisoned, message: str = "injected fault"):
        self.launch, self.poisoned, self.message, self.raised = launch, poisoned, message, 0

    def __call__(self, sb):
        if any(self.poisoned(r, sb) for r in sb.reqs):
            self.raised += 1
            raise RuntimeError(self.message)
        return self.launch(sb)


class GatedBackend(ScriptedBackend):
    """A ScriptedBackend whose generate calls wait until `width` of them are in flight at once (or `timeout`
    seconds passed), recording the most that were in flight together (`peak`): work that is started one group
    after another shows as a peak below the width."""

    def __init__(self, width: int, reply: str = "scripted", timeout: float = 2.0):
        super().__init__(reply)
        self.width, self.timeout, self.in_flight, self.peak = width, timeout, 0, 0
        self._full = None

    async def generate(self, text, params, images):
        self._full = self._full or asyncio.Event()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if self.in_flight >= self.width:
            self._full.set()
        try:
            await asyncio.wait_for(self._full.wait(), self.timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self.in_flight -= 1
        return await super().generate(text, params, images)


class DelayedCalls:
    """Wraps a function: every call sleeps `delay` seconds first (so that concurrent callers overlap it), then
    runs it; with `fail_first`, the first call raises RuntimeError(message) instead. `calls` counts every call."""

    def __init__(self, fn, delay: float = 0.2, fail_first: bool = False, message: str = "injected failure"):
        self.fn, self.delay, self.fail_first, self.message, self.calls = fn, delay, fail_first, message, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        first = self.calls == 1
        time.sleep(self.delay)
        if first and self.fail_first:
            raise RuntimeError(self.message)
        return self.fn(*args, **kwargs)


class SlowCompilerDouble:
    """Test double around a GrammarCache's xgrammar compiler: compiling a regex of `slow` takes `delay` seconds
    more (a sleep, which releases the GIL as xgrammar's C++ compile does); everything else is the real compiler's.
    Real regexes that compile slowly are slow on some xgrammar builds and CPUs only (0.5 s on one, seconds on
    another), so timing tests that need a slow compile make one with this."""

    def __init__(self, compiler, slow: tuple[str, ...], delay: float):
        self.compiler, self.slow, self.delay = compiler, slow, delay

    def compile_regex(self, text):
        if text in self.slow:
            time.sleep(self.delay)
        return self.compiler.compile_regex(text)

    def __getattr__(self, name):
        return getattr(self.compiler, name)

    @classmethod
    @contextlib.contextmanager
    def installed(cls, cache, *slow: str, delay: float = 2.0):
        """The double as a GrammarCache's compiler (an engine's: `engine.grammars`) for one test, the real one
        restored after."""
        real = cache._get_compiler()
        cache._compiler = cls(real, slow, delay)
        try:
            yield
        finally:
            cache._compiler = real
