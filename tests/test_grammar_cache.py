"""The compiled-grammar cache (lmc/runtime/grammar.py): a bounded LRU, compile timeouts, and a bound on how many
compilations may run at once (a timed-out one cannot be stopped)."""
import re
import threading
import time

import pytest

from lmc.runtime.core import RequestError
from lmc.runtime.grammar import GrammarBusy, GrammarCache

from doubles import SlowCompilerDouble

pytest.importorskip("xgrammar")


def _cache(engine, **kw) -> GrammarCache:
    cfg = engine.runner.cfg
    return GrammarCache(engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids, **kw)


def test_lru_keeps_the_recently_used_and_counts_evictions(engine):
    c = _cache(engine, max_entries=3)
    for i in range(3):
        c.compile("regex", f"[0-9]{{{i + 1}}}")
    c.compile("regex", "[0-9]{1}")  # a hit: now the most recently used
    c.compile("regex", "[0-9]{4}")  # evicts {2}, the least recently used
    assert list(c.compiled) == [("regex", "[0-9]{3}"), ("regex", "[0-9]{1}"), ("regex", "[0-9]{4}")]
    s = c.stats()
    assert (s["entries"], s["compiles"], s["evictions"]) == (3, 4, 1) and s["bytes"] > 0
    c.configure(max_bytes=1)  # a byte bound too: down to the newest entry
    assert list(c.compiled) == [("regex", "[0-9]{4}")] and c.stats()["evictions"] == 3


def test_concurrent_requests_for_one_grammar_compile_it_once(engine):
    c = _cache(engine)
    out = []
    threads = [threading.Thread(target=lambda: out.append(c.compile("regex", "[a-z]{40}"))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 6 and all(g is out[0] for g in out) and c.compiles == 1


def test_a_slow_compile_times_out_and_compilations_in_flight_are_bounded(engine):
    c = _cache(engine, compile_timeout=0.2, max_compiling=2)
    c.compile("regex", "[0-9]")  # builds the compiler (not part of what is timed)
    slow = ["[a-z ]{1,%d}" % n for n in (1201, 1202)]
    with SlowCompilerDouble.installed(c, *slow):
        t0 = time.monotonic()
        for regex in slow:
            with pytest.raises(RequestError, match=r"invalid regex '%s': it did not compile within 0.2 s"
                               % re.escape(regex)):
                c.compile("regex", regex)
        assert time.monotonic() - t0 < 2
        assert c.stats()["compiling"] == 2  # both still running: a third grammar is refused at once
        with pytest.raises(GrammarBusy, match="retry"):
            c.compile("regex", "[0-9]{2}")
        deadline = time.monotonic() + 120
        while c.stats()["compiling"] and time.monotonic() < deadline:
            time.sleep(0.1)
    assert c.stats()["compiling"] == 0 and c.stats()["timeouts"] == 2
    assert ("regex", "[a-z ]{1,1201}") in c.compiled  # the work was finished, and kept
    assert c.compile("regex", "[0-9]{2}") is not None


def test_invalid_grammar_is_a_request_error_naming_it(engine):
    c = _cache(engine)
    with pytest.raises(RequestError, match=r"invalid regex '\[a-'"):
        c.compile("regex", "[a-")
    assert c.stats()["compiling"] == 0 and not c.compiled
    with pytest.raises(ValueError, match="max_entries"):
        c.configure(max_entries=0)
