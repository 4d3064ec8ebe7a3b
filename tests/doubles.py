"""Test doubles (never used by lmc itself)."""
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
