"""A compiled program's next segment (a chain request's first text, after a host break or at a fork's branch)
joins the running decodes' forward when it is short, as a chain's next text does (scheduler/prefill.py): the
requests that decode meanwhile take no stall, and its output is the one it gets alone."""
import asyncio

FREE = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def test_a_chains_short_first_text_mixes_with_running_decodes(engine):
    prompt = "Count: one, two,"
    alone = engine.generate(prompt, {**FREE, "max_new_tokens": 4})["text"]

    async def run():
        long = asyncio.ensure_future(engine.async_generate("List the planets of the solar system:", FREE))
        while engine.stats()["running"] == 0:  # the long request decodes from here (24 forwards)
            await asyncio.sleep(0.005)
        mixed = engine.stats()["mixed_forwards"]
        items = [item async for item in engine.async_chain([{"text": prompt, "gen": {**FREE, "max_new_tokens": 4}}])]
        mixed = engine.stats()["mixed_forwards"] - mixed
        await long
        return items[-1], mixed, long.result()

    final, mixed, long = asyncio.run(run())
    assert len(long["output_ids"]) == 24 and mixed >= 1
    assert final["segments"][0]["text"] == alone
