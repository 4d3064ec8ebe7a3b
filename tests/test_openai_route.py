"""lmc.OpenAI picks the API route per program against a real `lmc serve` that offers both: a program without roles
(examples/extraction.py) goes to the completions route and gives Local's results at temperature 0; a program with
roles still goes to the chat route; on api.openai.com (no completions for chat models) the role-less program is
refused with the message that says what to do."""
import pytest

import lmc
from lmc.backend.openai import program_usage

from conftest import API_KEY
from test_examples import load

extraction = load("extraction")
DOC = "Ada Lovelace (10 December 1815 - 27 November 1852) was an English mathematician."


@lmc.function
def roleless_select(s, question):
    s += "Question: " + question + "\nAnswer:" + lmc.select("answer", [" yes", " no"])


@lmc.function
def with_roles(s):
    s += lmc.user("Name a colour.")
    s += lmc.assistant(lmc.gen("colour", max_tokens=6))


@pytest.fixture(scope="module")
def chat_backend(server):
    b = lmc.OpenAI("smollm2", base_url=server.url + "/v1", api_key=API_KEY)
    assert b.is_chat_model
    yield b
    b.shutdown()


def test_roleless_program_uses_completions_and_matches_local(engine, chat_backend):
    local = lmc.Local(engine=engine)
    prog = lmc.function(extraction.completion_body)
    remote = prog.run(doc=DOC, temperature=0, backend=chat_backend)
    assert remote.error() is None, remote.error()
    want = prog.run(doc=DOC, temperature=0, backend=local)
    assert remote.variables() == want.variables()
    assert program_usage(remote).calls == 3


def test_roleless_select_and_batch_on_a_chat_model(engine, chat_backend):
    local = lmc.Local(engine=engine)
    args = [{"question": "Is the sky blue?"}, {"question": "Is fire cold?"}]
    got = roleless_select.run_batch(args, backend=chat_backend)
    assert [s.error() for s in got] == [None, None]
    assert [s["answer"] for s in got] == [s["answer"] for s in roleless_select.run_batch(args, backend=local)]


def test_program_with_roles_still_uses_the_chat_route(engine, chat_backend):
    st = with_roles.run(temperature=0, backend=chat_backend)
    assert st.error() is None
    assert st["colour"] == with_roles.run(temperature=0, backend=lmc.Local(engine=engine))["colour"]


def test_roleless_program_on_the_openai_api_is_refused_clearly():
    """api.openai.com has no completions route for chat models: the role-less program fails before any call is
    sent, with the message naming assistant() and is_chat_model=False."""
    with pytest.raises(ValueError, match="inside an assistant turn.*is_chat_model=False"):
        lmc.function(extraction.completion_body).run(doc=DOC, backend=lmc.OpenAI("gpt-4o-mini", api_key="sk-none"))
