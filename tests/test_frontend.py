"""Conformance of the SGLang-compatible language on the real embedded model (temperature 0), and one test per
SGLang frontend defect that lmc fixes (each would fail on SGLang's behaviour)."""
import asyncio
import threading
import time

import pytest

import lmc as sgl
from doubles import ScriptedBackend


@pytest.fixture(scope="module")
def local(engine):
    backend = sgl.Local(engine=engine)
    sgl.set_default_backend(backend)
    yield backend
    sgl.set_default_backend(None)


@sgl.function
def capital(s, country):
    s += sgl.user(f"What is the capital of {country}? Answer with one word.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


def test_gen_answers_facts_and_roles_render_the_models_template(local, tokenizer):
    st = capital.run(country="France", temperature=0)
    assert "Paris" in st["answer"]
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[1]["content"] == st["answer"].strip()
    want = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert st.text().startswith(want[:want.index(msgs[1]["content"])])  # same rendering as the tokenizer's


def test_three_role_syntaxes_give_the_same_text(local):
    @sgl.function
    def expr_form(s):
        s += sgl.system("Be brief.") + sgl.user("Hi") + sgl.assistant("Hello")

    @sgl.function
    def begin_end(s):
        s += sgl.system_begin() + "Be brief." + sgl.system_end()
        s += sgl.user_begin() + "Hi" + sgl.user_end()
        s += sgl.assistant_begin() + "Hello" + sgl.assistant_end()

    @sgl.function
    def with_form(s):
        with s.system():
            s += "Be brief."
        with s.user():
            s += "Hi"
        s.assistant("Hello")

    texts = {f.run().text() for f in (expr_form, begin_end, with_form)}
    assert len(texts) == 1 and "Be brief." in texts.pop()


def test_select_methods_and_meta_info(local):
    @sgl.function
    def pick(s, method):
        s += "Q: What is the capital of Japan?\nA:"
        s += sgl.select("city", choices=[" Tokyo", " Paris", " London"], choices_method=method)

    for method in (sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        st = pick.run(method=method)
        assert st["city"] == " Tokyo", method
        meta = st.get_meta_info("city")
        assert len(meta["normalized_prompt_logprobs"]) == 3 and len(meta["input_token_logprobs"]) == 3
    assert "greedy_logprob_matrix" in pick.run(method=sgl.greedy_token_selection).get_meta_info("city")


def test_sampling_defaults_and_per_gen_overrides(local):
    @sgl.function
    def two(s):
        s += "Count: 1, 2, 3,"
        s += sgl.gen("short", max_tokens=2)
        s += sgl.gen("long")

    st = two.run(max_new_tokens=6, temperature=0, ignore_eos=True)
    assert st.get_meta_info("short")["completion_tokens"] == 2
    assert st.get_meta_info("long")["completion_tokens"] == 6
    st = two.run(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    assert st.get_meta_info("long")["completion_tokens"] == 6


def test_fork_join_gather_and_concat(local):
    @sgl.function
    def branches(s):
        s += "List three animals.\n"
        forks = s.fork(3)
        forks += lambda i: f"{i + 1}." + sgl.gen("animal", max_tokens=4, stop="\n")
        forks.join()

    st = branches.run(temperature=0)
    assert isinstance(st["animal"], list) and len(st["animal"]) == 3
    assert st.text() == "List three animals.\n"  # gather_variable leaves the parent text alone

    @sgl.function
    def concat(s):
        s += "Colors:"
        forks = s.fork(2)
        forks += [" red", " blue"]
        forks.join(mode="concate_and_append")
        s += "."

    assert concat.run().text() == "Colors: red blue."


def test_var_scope_copy_and_set_var(local):
    @sgl.function
    def scoped(s):
        with s.var_scope("intro"):
            s += "Hello there"
        with s.copy() as c:
            c += " (copy)"
        s["manual"] = 42

    st = scoped.run()
    assert st["intro"] == "Hello there" and st["manual"] == 42 and st.text() == "Hello there"


def test_reading_a_variable_waits_only_for_it(local):
    @sgl.function
    def slow(s):
        s += "Numbers:" + sgl.gen("a", max_tokens=1) + sgl.gen("b", max_tokens=60, ignore_eos=True)

    st = slow.run(stream=True, temperature=0)
    st["a"]
    assert "b" not in st  # a is ready while b is still generating
    st.sync()
    assert "b" in st


def test_streaming_sync_and_async(local):
    @sgl.function
    def story(s):
        s += "One sentence about the sea:" + sgl.gen("line", max_tokens=12)

    chunks = list(story.run(stream=True, temperature=0).text_iter("line"))
    assert len(chunks) > 1 and "".join(chunks) == story.run(temperature=0)["line"]

    async def main():
        st = story.run(stream=True, temperature=0)
        return [c async for c in st.text_async_iter()], await story.arun(temperature=0)

    chunks, st = asyncio.run(main())
    assert "".join(chunks) == st.text()


def test_run_batch_dicts_tuples_progress_and_async(local):
    rows = capital.run_batch([{"country": "France"}, ("Italy",)], temperature=0, progress_bar=True, num_threads=2)
    assert "Paris" in rows[0]["answer"] and "Rome" in rows[1]["answer"]
    rows = asyncio.run(capital.arun_batch([{"country": "Germany"}], temperature=0))
    assert "Berlin" in rows[0]["answer"]


def test_run_batch_isolates_failures_and_max_errors(local):
    @sgl.function
    def maybe(s, i):
        if i % 3 == 1:
            raise ValueError(f"bad item {i}")
        s += f"item {i}"

    out = maybe.run_batch([{"i": i} for i in range(7)], return_exceptions=True)
    assert [type(o).__name__ for o in out] == ["ProgramState", "ValueError", "ProgramState", "ProgramState",
                                               "ValueError", "ProgramState", "ProgramState"]
    out = maybe.run_batch([{"i": i} for i in range(7)], num_threads=1, max_errors=1)
    assert isinstance(out[1].error(), ValueError)
    assert all(isinstance(o.error(), sgl.BatchAborted) for o in out[2:])


def test_10000_trivial_programs_stay_under_64_threads(local):
    @sgl.function
    def trivial(s, i):
        s += f"item {i}"

    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], threading.active_count())
            time.sleep(0.002)

    w = threading.Thread(target=watch)
    w.start()
    out = trivial.run_batch([{"i": i} for i in range(10000)])
    done.set()
    w.join()
    assert peak[0] < 64 and out[9999].text() == "item 9999"


def test_bind_keeps_arguments_and_spec_tokens():
    @sgl.function(num_api_spec_tokens=64)
    def prog(s, a, b):
        s += f"{a} {b}"

    bound = prog.bind(a="x")
    assert bound.num_api_spec_tokens == 64  # SGLang's bind drops it
    assert bound.run(b="y", backend=ScriptedBackend()).text() == "x y"


def test_undefined_variable_names_the_defined_ones(local):
    st = capital.run(country="Spain", temperature=0)
    with pytest.raises(KeyError, match=r"'nope'.*\['answer'\]"):
        st["nope"]


def test_bad_regex_fails_at_construction():
    with pytest.raises(ValueError, match=r"invalid regex '\[a-'"):
        sgl.gen("x", regex="[a-")


def test_image_on_a_text_only_model_is_a_clear_error(local, tmp_path):
    png = tmp_path / "dot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 16)

    @sgl.function
    def look(s):
        s += sgl.user(sgl.image(str(png)) + "What is this?")

    with pytest.raises(ValueError, match="text-only"):
        look.run()


def test_worker_error_does_not_hang_later_sync(local):
    """SGLang: after a worker error, later submissions are never processed and sync() blocks forever."""
    @sgl.function
    def broken(s):
        s += "x" + sgl.gen("bad", max_tokens=-5)
        s += "more"

    st = broken.run(stream=True)
    t = threading.Thread(target=st.sync)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive() and "max_new_tokens" in str(st.error())
    with pytest.raises(ValueError, match="max_new_tokens"):
        st["bad"]
    with pytest.raises(ValueError, match="max_new_tokens"):
        broken.run()


def test_fork_commits_the_shared_prefix_before_branches(local):
    """SGLang checks the parent's text before syncing it, so the commit is often skipped and the branches race to
    compute the shared prefix. Here every branch finds it cached."""
    local.flush_cache()

    @sgl.function
    def branches(s):
        s += "A fairly long shared context about the history of astronomy and the planets. " * 4
        forks = s.fork(3)
        forks += sgl.gen("x", max_tokens=2)
        forks.join()

    st = branches.run(temperature=0)
    metas = st.get_meta_info("x")
    assert all(m["cached_tokens"] >= m["prompt_tokens"] - 2 for m in metas)


def test_nested_call_uses_the_callers_backend(local):
    """SGLang runs a nested program on the global default backend with default sampling parameters."""
    @sgl.function
    def inner(s):
        s += "Say hi:" + sgl.gen("hi", max_tokens=3)

    @sgl.function
    def outer(s):
        s["inner_text"] = inner().text()

    other = ScriptedBackend()
    sgl.set_default_backend(other)
    try:
        st = outer.run(backend=local, temperature=0)
    finally:
        sgl.set_default_backend(local)
    assert other.calls == [] and st["inner_text"].startswith("Say hi:")
    assert st["inner_text"] != "Say hi:scripted"


def test_typed_gens_parse_to_python_types(local):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        is_capital: bool

    @sgl.function
    def typed(s):
        s += "Q: How many days are in a week?\nA: " + sgl.gen_int("days", max_tokens=4) + "\n"
        s += "Is water wet? Answer True or False: " + sgl.gen("yes", dtype=bool, max_tokens=3) + "\n"
        s += "Q: Name a color.\nA: " + sgl.gen_string("color", max_tokens=8) + "\n"
        s += "Describe Paris as JSON: " + sgl.gen("city", json_schema=City, max_tokens=60)
        s += "\nAgain, as a dict schema: " + sgl.gen("city2", json_schema=City.model_json_schema(), max_tokens=60)
        s += "\nA phone number: " + sgl.gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=10)

    st = typed.run(temperature=0)
    assert isinstance(st["days"], int) and st["days"] == 7
    assert st["yes"] is True
    assert st["color"].startswith('"') and st["color"].endswith('"')
    for key in ("city", "city2"):
        city = City.model_validate_json(st[key])
        assert city.name == "Paris" and isinstance(city.is_capital, bool)
    import re
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", st["phone"])


def test_gen_n_returns_a_list(local):
    @sgl.function
    def many(s):
        s += "A random word:" + sgl.gen("w", n=3, max_tokens=3, temperature=1.0, seed=1)

    st = many.run()
    assert isinstance(st["w"], list) and len(st["w"]) == 3 and st.text().endswith(st["w"][0])


def test_fork_branches_are_batched_by_the_engine(local, engine):
    @sgl.function
    def four(s):
        s += "Write a word:"
        forks = s.fork(4)
        forks += sgl.gen("w", max_tokens=8, ignore_eos=True)
        forks.join()

    before = engine.stats()["decode_forwards"]
    four.run(temperature=0)
    assert engine.stats()["decode_forwards"] - before <= 12  # 4 branches x 7 decode steps, run together
