"""SGLang's own frontend (the `sglang` package, 0.5.10, installed by `make setup` without its server dependencies)
driving `lmc serve` on loopback through `sglang.RuntimeEndpoint`: the same program source, run by SGLang and by
lmc's frontend on the in-process engine, gives the same values at temperature 0.

SGLang picks a chat template from the server's model path; its registry has no SmolLM entry (it would fall back to
its plain `USER:` template), so the endpoint is told the model's own format, ChatML. The chat programs start with
a system turn: lmc, like the model's template, inserts SmolLM's default system prompt otherwise, and SGLang's
ChatML has none. `greedy_token_selection` is left out: SGLang's compares logprobs with float equality, and its
first column is the prompt's last token, the same for every choice up to batch-dependent noise (~1e-6), so SGLang's
pick among near-ties follows the noise (lmc's uses a tolerance)."""
import pytest

import lmc

from conftest import API_KEY as KEY

sglang = pytest.importorskip("sglang", reason="SGLang's frontend is not installed (`make setup` installs it)")



def programs(sgl):
    """The programs, written once against SGLang's API and built for `sgl` (the sglang or the lmc module)."""

    @sgl.function
    def few_shot(s, country):
        s += "Q: What is the capital of Japan?\nA: Tokyo\nQ: What is the capital of Italy?\nA: Rome\n"
        s += "Q: What is the capital of " + country + "?\nA:" + sgl.gen("capital", max_tokens=8, stop="\n")
        s += "\nThe year it was founded: " + sgl.gen("year", max_tokens=6, regex=r"[0-9]{3,4}")
        s += "\nIs it a large city? " + sgl.select("large", choices=["yes", "no"],
                                                     choices_method=sgl.token_length_normalized)
        s += "\nA city of the same country: " + sgl.select("other", choices=["Lyon", "Madrid", "Osaka"])

    @sgl.function
    def chat(s, topic):
        s += sgl.system("You answer in a few words.")
        s += sgl.user(f"Name something about {topic}.")
        s += sgl.assistant(sgl.gen("first", max_tokens=10))
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += sgl.user(f"Give fact number {i + 1} about {topic}.")
            f += sgl.assistant(sgl.gen("fact", max_tokens=10))
        forks.join()
        s += sgl.user("Is that true? Answer yes or no.")
        s += sgl.assistant(sgl.select("verdict", choices=["yes", "no"]))

    @sgl.function
    def story(s):
        s += "Once upon a time, in a small village by the sea,"
        s += sgl.gen("story", max_tokens=12)

    return {"few_shot": few_shot, "chat": chat, "story": story}


@pytest.fixture(scope="module")
def backends(engine, server):
    return {sglang: sglang.RuntimeEndpoint(server.url, api_key=KEY, chat_template_name="chatml"),
            lmc: lmc.Local(engine=engine)}


def _run(mod, backends, name: str, **kwargs):
    return programs(mod)[name].run(backend=backends[mod], temperature=0, **kwargs)


@pytest.mark.parametrize("name,kwargs", [("few_shot", {"country": "France"}), ("chat", {"topic": "the moon"})],
                         ids=["few_shot", "chat"])
def test_sglang_program_gives_lmc_values(backends, name, kwargs):
    want = _run(lmc, backends, name, **kwargs)
    got = _run(sglang, backends, name, **kwargs)
    values = want.variables()
    assert values and all(v not in ("", None, []) for v in values.values()), values
    assert {n: got[n] for n in values} == values
    assert got.text() == want.text()


def test_sglang_run_batch_and_streaming(backends):
    batch = [{"country": c} for c in ("Spain", "Germany")]
    want = [s.variables() for s in programs(lmc)["few_shot"].run_batch(batch, backend=backends[lmc], temperature=0)]
    got = programs(sglang)["few_shot"].run_batch(batch, backend=backends[sglang], temperature=0)
    assert [{n: s[n] for n in w} for s, w in zip(got, want)] == want

    state = programs(sglang)["story"].run(backend=backends[sglang], temperature=0, stream=True)
    pieces = list(state.text_iter("story"))
    want = _run(lmc, backends, "story")["story"]
    assert len(pieces) > 1 and "".join(pieces) == want == state["story"]


def test_sglang_endpoint_housekeeping(backends):
    """The other routes SGLang's RuntimeEndpoint calls: /server_info, and /flush_cache (accepted when idle)."""
    endpoint = backends[sglang]
    assert endpoint.get_model_name() == "smollm2-135m-instruct"
    assert endpoint.get_server_info()["internal_states"][0]["running"] == 0
    endpoint.flush_cache()
