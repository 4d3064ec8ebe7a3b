"""The paper's workloads as lmc programs over the data in benchmarks/suite/data (written by make_data.py).

Each workload is a batch of program calls plus a statement of its sharing structure: which prompt prefixes its
programs have in common. Shapes follow SGLang's benchmark/ programs; output lengths are cut to what two CPU cores
run in minutes. Each builder takes the batch size `n` (programs); SIZES names four sets of them: "quick" (one or
two programs, for CI), "small" (the batches of the first recordings, a few programs), "recorded" (the CPU
run: batches sized for a 22-minute command with every system on two shared cores, see SIZES) and "large" (lmc
against vLLM only, several programs in flight in every workload); run.py's --programs overrides single workloads.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import lmc

DATA = Path(__file__).with_name("data")


@lru_cache(maxsize=None)
def data(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


@dataclass
class Workload:
    """A batch of program calls. `calls` run together for throughput (grouped per program, every group in
    flight at once); the first `latency_calls` run one at a time, in order, for latency."""

    name: str
    sharing: str
    calls: list[tuple[lmc.Program, dict]]
    latency_calls: int = 1
    uses: list[str] = field(default_factory=list)  # the DSL features it exercises

    def __post_init__(self):
        self.latency_calls = min(self.latency_calls, len(self.calls))  # invariant: 1 <= latency_calls <= calls


# ---- 5-shot MMLU-style multiple choice -----------------------------------------------------------------------------
def _mmlu_item(q: dict, answer: str = "") -> str:
    opts = "".join(f"\n{letter}. {c}" for letter, c in zip("ABCD", q["choices"]))
    return f"{q['question']}{opts}\nAnswer:{' ' + answer if answer else ''}"


@lmc.function
def mmlu_question(s, examples, question):
    s += examples + question + lmc.select("answer", [" A", " B", " C", " D"])


def mmlu(n: int) -> Workload:
    subjects = data("mmlu")["subjects"][:4 if n >= 16 else 2]
    per_subject = -(-n // len(subjects))
    calls = []
    for sub in subjects:
        examples = (f"The following are multiple choice questions (with answers) about {sub['subject']}.\n\n"
                    + "".join(_mmlu_item(e, e["answer"]) + "\n\n" for e in sub["examples"]))
        calls += [(mmlu_question, {"examples": examples, "question": _mmlu_item(q)})
                  for q in sub["questions"][:per_subject]]
    calls = calls[:n]
    return Workload("mmlu", "programs of one subject share its 5-shot block (~450 tokens); subjects share the "
                            "instruction line", calls, uses=["select (single-token choices)"])


# ---- 20-shot HellaSwag-style select over 4 endings -----------------------------------------------------------------
@lmc.function
def hellaswag_question(s, shots, ctx, endings):
    s += shots + ctx
    s += lmc.select("answer", choices=list(endings))


def hellaswag(n: int) -> Workload:
    d = data("hellaswag")
    shots = "".join(x["ctx"] + x["endings"][x["label"]] + "\n\n" for x in d["shots"])
    calls = [(hellaswag_question, {"shots": shots, "ctx": q["ctx"], "endings": tuple(q["endings"])})
             for q in d["questions"][:n]]
    return Workload("hellaswag", "two levels: every program shares the 20-shot block (~1,300 tokens); the 4 "
                                 "endings of one program share its context", calls, latency_calls=1,
                    uses=["select (multi-token)"])


# ---- ReAct traces replayed with recorded observations ------------------------------------------------------------
@lmc.function
def react_trace(s, prefix, question, steps, max_tokens=24):
    s += prefix + "Question: " + question + "\n"
    for i, step in enumerate(steps, 1):
        s += f"Thought {i}:"
        f = s.fork(1)  # the model's own step is generated, then discarded for the recorded one (a replay)
        f += lmc.gen(f"thought_action_{i}", max_tokens=max_tokens, stop="Observation")
        f.join()
        s += f" {step['thought']}\nAction {i}: {step['action']}\nObservation {i}: {step['observation']}\n"


def react(n: int) -> Workload:
    d = data("react")
    calls = [(react_trace, {"prefix": d["prefix"], "question": t["question"], "steps": t["steps"],
                            "max_tokens": 12}) for t in d["traces"][:n]]
    return Workload("react", "every trace shares the 4-example ReAct prefix (~1,000 tokens); each step extends its "
                             "trace's previous text (recorded observations appended)", calls, latency_calls=1,
                    uses=["fork(1) + join", "host data between gens"])


# ---- generative-agents-style replay ------------------------------------------------------------------------------
AGENT_WORLD = ("You are simulating the residents of a small town: Ava the baker, Ben the librarian, Chloe the "
               "painter, Dan the mechanic and their neighbours. The town has a library, a bakery, a park, a market, "
               "a school, a museum, a harbor, a garden, a station and a cafe. Every answer is short and follows the "
               "format of the examples exactly.\n\n")
AGENT_SHOTS = {
    "poignancy": ("On the scale of 1 to 10, where 1 is purely mundane (e.g., brushing teeth, making bed) and 10 "
                  "is extremely poignant (e.g., a break up, college acceptance), rate the likely poignancy of "
                  "the following event.\n"
                  "Persona: Ava\nEvent: Ava is brushing her teeth at home\nRate: 1\n\n"
                  "Persona: Ben\nEvent: Ben is moving to a new city for a job\nRate: 8\n\n"
                  "Persona: Chloe\nEvent: Chloe is buying bread at the bakery\nRate: 2\n\n"),
    "triple": ("Turn the action into a (subject, predicate, object) triple.\n"
               "Persona: Dan\nAction: Dan is repairing the bicycle\nTriple: (Dan, repair, bicycle)\n\n"
               "Persona: Ava\nAction: Ava is baking bread for the market\nTriple: (Ava, bake, bread)\n\n"
               "Persona: Ben\nAction: Ben is shelving the new books\nTriple: (Ben, shelve, books)\n\n"),
    "emoji": ("Convert an action description to two emojis.\n"
              "Action: sleeping at home\nEmoji: 😴🏠\n\n"
              "Action: eating at the cafe\nEmoji: 🍽️☕\n\n"
              "Action: reading at the library\nEmoji: 📖📚\n\n"),
    "sector": ("Pick the one area, from the list, where the persona should go for the action. Answer inside "
               "curly brackets.\n"
               "Persona: Chloe\nAreas: park, museum, bakery, school\nAction: buy some paint brushes\n"
               "Area: {museum}\n\n"
               "Persona: Dan\nAreas: harbor, garden, station, cafe\nAction: catch a train\nArea: {station}\n\n"
               "Persona: Ava\nAreas: market, library, park, bakery\nAction: sell some bread\nArea: {market}\n\n"),
    "arena": ("Pick the one spot, from the list, inside the area where the persona should go. Answer inside "
              "curly brackets.\n"
              "Persona: Ben\nArea: library\nSpots: reading room, front desk, archive, garden\nSpot: {front desk}\n\n"
              "Persona: Chloe\nArea: park\nSpots: bench, pond, playground, gate\nSpot: {bench}\n\n"
              "Persona: Dan\nArea: garage\nSpots: workbench, office, yard, shelf\nSpot: {workbench}\n\n"),
}


@lmc.function
def agent_poignancy(s, persona, event):
    s += AGENT_WORLD + AGENT_SHOTS["poignancy"] + f"Persona: {persona}\nEvent: {event}\nRate:"
    s += lmc.gen("rate", max_tokens=2)


@lmc.function
def agent_triple(s, persona, action):
    s += AGENT_WORLD + AGENT_SHOTS["triple"] + f"Persona: {persona}\nAction: {action}\nTriple: ("
    s += lmc.gen("triple", max_tokens=20, stop=")")


@lmc.function
def agent_emoji(s, action):
    s += AGENT_WORLD + AGENT_SHOTS["emoji"] + f"Action: {action}\nEmoji:"
    s += lmc.gen("emoji", max_tokens=6, stop="\n")


@lmc.function
def agent_sector(s, persona, sectors, action):
    s += AGENT_WORLD + AGENT_SHOTS["sector"] + f"Persona: {persona}\nAreas: {sectors}\nAction: {action}\nArea: {{"
    s += lmc.gen("location", max_tokens=10, stop="}")


@lmc.function
def agent_arena(s, persona, sector, arenas):
    s += AGENT_WORLD + AGENT_SHOTS["arena"] + f"Persona: {persona}\nArea: {sector}\nSpots: {arenas}\nSpot: {{"
    s += lmc.gen("area", max_tokens=5, stop="}")


AGENT_FUNCS = {"poignancy": agent_poignancy, "triple": agent_triple, "emoji": agent_emoji, "sector": agent_sector,
               "arena": agent_arena}


def agents(n: int) -> Workload:
    calls = [(AGENT_FUNCS[c["func"]], c["args"]) for c in data("agents")["calls"][:n]]
    return Workload("generative_agents", "5 functions, each call of one function shares its few-shot prompt; all "
                                         "five share the world description (~120 tokens); recorded calls replayed",
                    calls, uses=["5 programs in one batch", "stop strings"])


# ---- tree of thought on GSM8K-style problems ---------------------------------------------------------------------
@lmc.function
def tree_of_thought(s, question, plan_tokens=24, solution_tokens=24):
    s += lmc.system("You are a careful math tutor.")
    s += lmc.user(f"Question: {question}\nPropose a short plan to solve it.")
    plans = s.fork(2)
    for i, f in enumerate(plans):
        f += lmc.assistant(f"Plan {i + 1}:" + lmc.gen("plan", max_tokens=plan_tokens, stop="\n\n"))
        f += lmc.user("Carry out the plan and give the final number.")
        sols = f.fork(2)
        for j, g in enumerate(sols):
            g += lmc.assistant(f"Solution {j + 1}:" + lmc.gen("solution", max_tokens=solution_tokens, stop="\n\n"))
            g += lmc.user("Is this solution correct? Answer yes or no.")
            g += lmc.assistant(lmc.select("verdict", choices=["yes", "no"]))
        sols.join()
    plans.join()


def tree_of_thought_workload(n: int) -> Workload:
    qs = data("gsm8k")["questions"][:n]
    calls = [(tree_of_thought, {"question": q["question"], "plan_tokens": 12, "solution_tokens": 12}) for q in qs]
    return Workload("tree_of_thought", "a 2 x 2 tree per problem: both plans share the question, both solutions "
                                       "of a plan share the plan, each verdict's choices share the solution; "
                                       "problems share the system prompt", calls, latency_calls=1,
                    uses=["nested forks", "select"])


# ---- skeleton of thought: tip suggestion -------------------------------------------------------------------------
EXPAND_SHOTS = ("Please expand a tip for a topic into a detailed paragraph.\n\n"
                "Topic: staying healthy\nTip: Regular Exercise\nParagraph: Incorporate physical activity into your "
                "daily routine. Aim for at least 150 minutes of moderate aerobic exercise or 75 minutes of vigorous "
                "exercise each week, and include strength training twice a week.\n\n"
                "Topic: building a campfire\nTip: Choose the Right Location\nParagraph: Always build your campfire "
                "in a safe spot. This means selecting a location that is away from trees, bushes and other "
                "flammable materials, ideally in a fire ring or pit.\n\n"
                "Topic: writing a blog post\nTip: structure your content effectively\nParagraph: A well-structured "
                "post is easier to read. Start with an engaging introduction, use headings to break the text into "
                "sections, and end with a conclusion that sums up your key points.\n\n")


@lmc.function
def expand_tip(s, topic, tip, paragraph_tokens=32):
    s += EXPAND_SHOTS + "Topic: " + topic + "\nTip: " + tip + "\nParagraph:"
    s += lmc.gen("paragraph", max_tokens=paragraph_tokens, stop="\n\n", temperature=0)


@lmc.function
def suggest_tips(s, topic, num_tips=3, paragraph_tokens=32):
    s += ("Please act as a helpful assistant. Your job is to provide users with useful tips on a specific topic.\n"
          "Give exactly three tips, one short phrase each.\nTopic: " + topic + "\nTips:\n")
    paragraphs = []
    for i in range(1, num_tips + 1):
        s += f"{i}." + lmc.gen(f"tip_{i}", max_tokens=12, stop=[".", "\n"]) + ".\n"
        paragraphs.append(expand_tip(topic=topic, tip=s[f"tip_{i}"], paragraph_tokens=paragraph_tokens))
    for i, p in enumerate(paragraphs, 1):
        s += f"Tip {i}:" + p["paragraph"] + "\n"


def tips(n: int) -> Workload:
    calls = [(suggest_tips, {"topic": t, "paragraph_tokens": 16}) for t in data("topics")["topics"][:n]]
    return Workload("skeleton_of_thought", "each tip is expanded by a nested program whose 3-shot prompt "
                                           "(~200 tokens) every expansion shares; skeletons share their instruction",
                    calls, latency_calls=1, uses=["nested program calls on generated values"])


# ---- LLM judge: branch-solve-merge -------------------------------------------------------------------------------
JUDGE_DIMS = ["clarity", "accuracy", "structure", "persuasiveness"]
JUDGE_SYSTEM = ("You are an expert essay judge. You read the article, judge it on one dimension at a time with "
                "a short reason, and finally give an overall score from 1 to 10.\n\n")


@lmc.function
def judge(s, title, article, judgement_tokens=24):
    s += JUDGE_SYSTEM + "Title: " + title + "\nArticle: " + article + "\n\n"
    forks = s.fork(len(JUDGE_DIMS))
    for f, dim in zip(forks, JUDGE_DIMS):
        f += f"USER: Judge the article's {dim} in one sentence, then write END.\nJUDGE:"
        f += lmc.gen("judgement", max_tokens=judgement_tokens, stop="END")
    forks.join()
    for i, dim in enumerate(JUDGE_DIMS):
        s += f"{dim.capitalize()}: " + forks[i]["judgement"] + "\n"
    s += "Overall score (1-10):" + lmc.gen("score", max_tokens=2)


def judge_workload(n: int) -> Workload:
    calls = [(judge, {"title": a["title"], "article": a["text"], "judgement_tokens": 12})
             for a in data("articles")["articles"][:n]]
    return Workload("llm_judge", "4 judgement branches per article share the article (~250 tokens); the merge "
                                 "extends the article with the judgements; articles share the system text",
                    calls, latency_calls=1, uses=["fork(4) + join", "merge over branch values"])


# ---- JSON decoding with a regex schema ---------------------------------------------------------------------------
REGEX_LIST = r'\["[\w ]{1,16}"(, "[\w ]{1,16}"){0,2}\]'


@lmc.function
def json_decode(s, document):
    s += "Please extract the information of a city from the following document and output it as JSON.\n"
    s += "Document: " + document + "\nHere is the JSON:\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + lmc.gen("name", max_tokens=12, regex=lmc.REGEX_STR + ",") + "\n"
        s += '  "country": ' + lmc.gen("country", max_tokens=12, regex=lmc.REGEX_STR + ",") + "\n"
        s += '  "population": ' + lmc.gen("population", max_tokens=10, regex=lmc.REGEX_INT + ",") + "\n"
        s += '  "area": ' + lmc.gen("area", max_tokens=10, regex=lmc.REGEX_FLOAT + ",") + "\n"
        s += '  "sights": ' + lmc.gen("sights", max_tokens=24, regex=REGEX_LIST) + "\n"
        s += "}"


def json_workload(n: int) -> Workload:
    calls = [(json_decode, {"document": d["document"]}) for d in data("cities")["documents"][:n]]
    return Workload("json_decode", "each document (~350 tokens) is its own; programs share only the instruction; "
                                   "5 regex-constrained fields between constant keys", calls, latency_calls=1,
                    uses=["regex gens", "var_scope"])


# ---- multi-turn chat ---------------------------------------------------------------------------------------------
def _random_prompt(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of random alphanumeric words (SGLang's data_gen.py for this benchmark)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return " ".join("".join(rng.choice(alphabet) for _ in range(rng.randrange(2, 6))) for _ in range(tokens // 3))


@lmc.function
def multi_turn_chat(s, turns):
    for i, (prompt, new_tokens) in enumerate(turns):
        s += prompt
        s += lmc.gen(f"answer_{i}", max_tokens=new_tokens, ignore_eos=True)


# The paper's long chat generates 256-512 tokens a turn; on two shared cores, 3 runs x 4 systems of that take over an
# hour, so the recorded run generates 32-64 (pass long_outputs=(256, 512) to chat() for the paper's length).
LONG_OUTPUTS = (32, 64)


def chat(n: int, long: bool, long_outputs: tuple[int, int] = LONG_OUTPUTS) -> Workload:
    rng = random.Random(7 if long else 5)
    prompt_lo, prompt_hi = 256, 512
    out_lo, out_hi = long_outputs if long else (4, 8)
    calls = [(multi_turn_chat, {"turns": [(_random_prompt(rng, rng.randrange(prompt_lo, prompt_hi)),
                                           rng.randrange(out_lo, out_hi + 1)) for _ in range(4)]})
             for _ in range(n)]
    name = "multi_turn_chat_long" if long else "multi_turn_chat_short"
    return Workload(name, f"4 turns; each turn's prompt extends the whole history (prompts {prompt_lo}-{prompt_hi} "
                          f"tokens, outputs {out_lo}-{out_hi} tokens, ignore_eos); conversations share nothing "
                          "(synthetic random words, seeded)", calls, latency_calls=1,
                    uses=["growing history"])


# ---- RAG-style pipeline over a local document list ----------------------------------------------------------------
def retrieve(question: str, docs: list[dict], k: int = 3) -> list[dict]:
    """Top-k documents by word overlap with the question (ties by id), returned in id order: the same documents
    always make the same context, so questions that retrieve them share its prefix."""
    q = set(re.findall(r"\w+", question.lower()))
    scored = sorted(docs, key=lambda d: (-len(q & set(re.findall(r"\w+", (d["title"] + " " + d["text"]).lower()))),
                                         d["id"]))
    return sorted(scored[:k], key=lambda d: d["id"])


@lmc.function
def rag_answer(s, context, question):
    s += lmc.system("Answer the question from the documents in one short sentence.")
    s += lmc.user("Documents:\n" + context + "\nQuestion: " + question)
    s += lmc.assistant(lmc.gen("answer", max_tokens=16, stop="\n"))


def rag(n: int) -> Workload:
    d = data("rag")
    calls = []
    for q in d["questions"][:n]:
        docs = retrieve(q["question"], d["documents"])
        context = "".join(f"[{x['id']}] {x['title']}: {x['text']}\n" for x in docs)
        calls.append((rag_answer, {"context": context, "question": q["question"]}))
    return Workload("rag", "retrieval on the host (word overlap, top 3 of 24 documents, in id order): questions "
                           "retrieving the same first documents share that context; all share the system turn",
                    calls, uses=["roles", "host retrieval"])


BUILDERS = {
    "mmlu": mmlu, "hellaswag": hellaswag, "react": react, "generative_agents": agents,
    "tree_of_thought": tree_of_thought_workload, "skeleton_of_thought": tips, "llm_judge": judge_workload,
    "json_decode": json_workload, "multi_turn_chat_short": lambda n: chat(n, long=False),
    "multi_turn_chat_long": lambda n: chat(n, long=True), "rag": rag,
}
# Programs per workload in each named size. "recorded" is the recorded CPU run: 3 runs of every system plus the
# ablation within one 22-minute command (run.py --budget-min 22, latency measured in the first run only). Measured
# throughput pass, all four systems summed, per program (2026-12-01 18:10-18:35 UTC, load 6-9, one run at mmlu 16,
# hellaswag 8, react 4, agents 48, tree_of_thought 8, skeleton 4, judge 8, json 4, chats 4 and 2, rag 16): mmlu
# 8 s, hellaswag 43 s, react 32 s, agents 1.6 s, tree_of_thought 11 s, skeleton 15 s, judge 16 s, json 15 s,
# short chat 44 s, long chat 133 s, rag 6 s. Batching buys little on two cores (every system is compute-bound, the
# radix-cache-off baseline recomputes every shared prefix, vLLM scores selects by echo without its cache), so a
# run costs about that per program: 32-64 programs per workload would take hours. The one-program workloads take
# most of the ~380 s a run can have (the first recording's sizes: 3 runs in 19 minutes); doubling mmlu,
# generative_agents and tree_of_thought adds ~75 s a run, which measuring latency in the first run only pays for.
# The data files hold more items (hellaswag 64, mmlu 4 x 24, agents 48, the rest 16-32): a quieter machine or a
# longer budget should raise them with --programs.
SIZES = {
    "quick": {"mmlu": 2, "hellaswag": 2, "react": 1, "generative_agents": 5, "tree_of_thought": 1,
              "skeleton_of_thought": 1, "llm_judge": 1, "json_decode": 1, "multi_turn_chat_short": 1,
              "multi_turn_chat_long": 1, "rag": 2},
    "small": {"mmlu": 6, "hellaswag": 4, "react": 2, "generative_agents": 10, "tree_of_thought": 2,
              "skeleton_of_thought": 2, "llm_judge": 2, "json_decode": 2, "multi_turn_chat_short": 2,
              "multi_turn_chat_long": 1, "rag": 3},
    "recorded": {"mmlu": 8, "hellaswag": 1, "react": 1, "generative_agents": 24, "tree_of_thought": 4,
                 "skeleton_of_thought": 1, "llm_judge": 2, "json_decode": 1, "multi_turn_chat_short": 1,
                 "multi_turn_chat_long": 1, "rag": 6},
    # lmc and vLLM only (run.py --size large --systems lmc,vllm): every workload with a batch of several programs
    # in flight, 3 runs in a 22-minute command. From suite_cpu.json's per-program cost of those two systems summed
    # (mmlu 2.4 s, hellaswag 11.8, react 9.5, agents 0.27, tree_of_thought 2.8, skeleton 8, judge 2.6, json 6.2,
    # short chat 10.3, long chat 33, rag 1.4): about 400 s a run.
    "large": {"mmlu": 32, "hellaswag": 4, "react": 4, "generative_agents": 48, "tree_of_thought": 16,
              "skeleton_of_thought": 4, "llm_judge": 8, "json_decode": 4, "multi_turn_chat_short": 4,
              "multi_turn_chat_long": 2, "rag": 24},
}


def build(name: str, size: str = "small", n: int | None = None) -> Workload:
    """Workload `name` with the batch of the named size, or of `n` programs."""
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(BUILDERS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    n = SIZES[size][name] if n is None else n
    if n < 1:
        raise ValueError(f"{name}: the batch needs at least one program, got {n}")
    return BUILDERS[name](n)
