"""Writes the suite's synthetic data files (benchmarks/suite/data/*.json) from a fixed seed: no downloads.

The workloads measure serving speed and prefix reuse, not accuracy, so the data only has to have the shapes of the
paper's data sets (SGLang's benchmark/ directory): a few-shot block per MMLU subject, HellaSwag contexts with four
endings, ReAct traces with recorded observations, generative-agents calls for five functions, GSM8K-style word
problems, tip topics, essays, city documents, and a small document list for retrieval. Re-running this script
gives byte-identical files.

    python benchmarks/suite/make_data.py
"""
from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).with_name("data")
NAMES = ["Ava", "Ben", "Chloe", "Dan", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Liam", "Maya",
         "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "shells", "cards", "coins", "stamps"]
PLACES = ["library", "bakery", "park", "market", "school", "museum", "harbor", "garden", "station", "cafe"]
WORDS = ("river mountain signal copper lantern meadow circuit harbor velvet glacier orbit canyon ember quartz "
         "willow beacon prism tundra falcon mosaic cedar nebula basalt harvest compass ripple summit thistle "
         "archive delta fjord granite horizon ivory jasmine kelp lagoon marble nectar onyx pepper quiver "
         "saffron timber umber violet walnut yarrow zephyr").split()
SUBJECTS = {
    "astronomy": [("Which planet is closest to the Sun?", ["Venus", "Mercury", "Mars", "Earth"], 1),
                  ("What is a light-year a unit of?", ["time", "brightness", "distance", "mass"], 2),
                  ("Which object is at the center of the Solar System?", ["the Moon", "Jupiter", "the Sun",
                                                                          "Earth"], 2),
                  ("What do we call a star that suddenly brightens?", ["a nova", "a comet", "a moon", "a planet"], 0),
                  ("Which planet has the most prominent rings?", ["Mars", "Saturn", "Venus", "Mercury"], 1)],
    "biology": [("Which organelle makes most of a cell's energy?", ["nucleus", "ribosome", "mitochondrion",
                                                                    "vacuole"], 2),
                ("What carries oxygen in the blood?", ["hemoglobin", "insulin", "keratin", "collagen"], 0),
                ("Which molecule stores genetic information?", ["glucose", "DNA", "cellulose", "lipid"], 1),
                ("What process do plants use to make sugar?", ["respiration", "digestion", "photosynthesis",
                                                               "fermentation"], 2),
                ("How many chambers does a human heart have?", ["two", "three", "four", "five"], 2)],
    "economics": [("What is inflation?", ["falling prices", "rising prices", "rising output", "falling wages"], 1),
                  ("Who sets interest rates in most countries?", ["the central bank", "the courts",
                                                                  "the army", "the schools"], 0),
                  ("What does GDP measure?", ["population", "total output", "land area", "literacy"], 1),
                  ("When demand rises and supply is fixed, price tends to", ["fall", "stay", "rise", "vanish"], 2),
                  ("A tax on imported goods is called", ["a tariff", "a subsidy", "a loan", "a dividend"], 0)],
    "geography": [("Which is the longest river in Africa?", ["Congo", "Niger", "Nile", "Zambezi"], 2),
                  ("Which ocean lies between Africa and Australia?", ["Atlantic", "Indian", "Arctic",
                                                                      "Pacific"], 1),
                  ("What is the capital of Canada?", ["Toronto", "Vancouver", "Ottawa", "Montreal"], 2),
                  ("Which desert is the largest hot desert?", ["Gobi", "Sahara", "Kalahari", "Atacama"], 1),
                  ("Mount Everest lies in which mountain range?", ["Andes", "Alps", "Rockies", "Himalayas"], 3)],
}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def mmlu(rng):
    subjects = []
    for name, shots in SUBJECTS.items():
        questions = []
        for i in range(24):
            a, b = rng.sample(WORDS, 2)
            opts = rng.sample(WORDS, 4)
            questions.append({"question": f"In {name}, which term is most closely related to {a} and {b} "
                                          f"(item {i + 1})?", "choices": opts})
        subjects.append({"subject": name, "examples": [{"question": q, "choices": c, "answer": "ABCD"[k]}
                                                       for q, c, k in shots], "questions": questions})
    return {"subjects": subjects}


def hellaswag(rng):
    def item():
        who, place, thing = rng.choice(NAMES), rng.choice(PLACES), rng.choice(ITEMS)
        ctx = (f"{who} walks into the {place} carrying a bag of {thing}. {who} sets the bag down on a table and "
               f"looks around at the {words(rng, 3)}.")
        endings = [f" {who} {v} the {thing} {words(rng, 4)}." for v in
                   ("starts sorting", "hands out", "counts", "puts away")]
        rng.shuffle(endings)
        return {"ctx": ctx, "endings": endings, "label": rng.randrange(4)}
    return {"shots": [item() for _ in range(20)], "questions": [item() for _ in range(64)]}


def react(rng):
    def trace(q_i):
        a, b = rng.sample(NAMES, 2)
        place = rng.choice(PLACES)
        q = f"Which of {a} and {b} opened the {place} on {words(rng, 2)} street first (question {q_i})?"
        steps = []
        for i, who in enumerate((a, b)):
            year = 1900 + rng.randrange(120)
            steps.append({"thought": f"I need to find when {who} opened the {place}.",
                          "action": f"Search[{who} {place}]",
                          "observation": f"{who} opened the {place} in {year}. It is known for its "
                                         f"{words(rng, 12)}."})
        steps.append({"thought": "Now I can compare the two years.", "action": f"Finish[{rng.choice((a, b))}]",
                      "observation": "Episode finished."})
        return {"question": q, "steps": steps}
    examples = "".join(
        f"Question: {t['question']}\n" + "".join(
            f"Thought {i}: {s['thought']}\nAction {i}: {s['action']}\nObservation {i}: {s['observation']}\n"
            for i, s in enumerate(t["steps"], 1)) + "\n" for t in (trace(f"example {k}") for k in range(4)))
    instruction = ("Solve a question answering task with interleaving Thought, Action, Observation steps. Thought "
                   "can reason about the current situation, and Action can be three types: Search[entity], "
                   "Lookup[keyword] and Finish[answer].\nHere are some examples.\n")
    return {"prefix": instruction + examples, "traces": [trace(k) for k in range(24)]}


def agents(rng):
    calls = []
    for i in range(48):
        who = rng.choice(NAMES)
        kind = ["poignancy", "triple", "emoji", "sector", "arena"][i % 5]
        if kind == "poignancy":
            args = {"persona": who, "event": f"{who} is {rng.choice(['reading', 'cooking', 'painting'])} "
                                             f"at the {rng.choice(PLACES)}"}
        elif kind == "triple":
            args = {"persona": who, "action": f"{who} is {rng.choice(['buying', 'repairing', 'sorting'])} "
                                              f"{rng.choice(ITEMS)}"}
        elif kind == "emoji":
            args = {"action": f"{rng.choice(['sleeping', 'running', 'writing', 'eating'])} at the "
                              f"{rng.choice(PLACES)}"}
        elif kind == "sector":
            args = {"persona": who, "sectors": ", ".join(rng.sample(PLACES, 4)),
                    "action": f"get some {rng.choice(ITEMS)}"}
        else:
            args = {"persona": who, "sector": rng.choice(PLACES), "arenas": ", ".join(rng.sample(WORDS, 4))}
        calls.append({"func": kind, "args": args})
    return {"calls": calls}


def gsm8k(rng):
    qs = []
    for _ in range(24):
        a, b = rng.sample(NAMES, 2)
        item = rng.choice(ITEMS)
        x, y, z = rng.randrange(3, 30), rng.randrange(2, 9), rng.randrange(1, 12)
        qs.append({"question": f"{a} has {x} {item}. {b} gives {a} {y} times as many {item} as {a} already has, "
                               f"and then {a} gives away {z}. How many {item} does {a} have now?",
                   "answer": x + x * y - z})
    return {"questions": qs}


def topics(rng):
    return {"topics": ["staying healthy", "learning a language", "saving money", "sleeping well", "cooking at home",
                       "writing clearly", "running a meeting", "studying for exams", "gardening", "travelling light",
                       "public speaking", "keeping plants alive", "reading more", "moving house",
                       "learning to swim", "starting a blog"]}


def articles(rng):
    out = []
    for i in range(16):
        topic = rng.choice(["city parks", "school lunches", "public libraries", "night trains", "bike lanes",
                            "community gardens", "museum hours", "recycling"])
        body = " ".join(f"{s.capitalize()} {words(rng, 10)}." for s in
                        (f"many people believe {topic} matter", "the data is mixed", "a survey found support",
                         "critics point to costs", "supporters point to health", "the city council will vote",
                         "in the end the choice is local", "experts urge more study"))
        out.append({"title": f"On {topic} ({i + 1})", "text": body})
    return {"articles": out}


def cities(rng):
    docs = []
    for i in range(24):
        name = f"{rng.choice(WORDS).capitalize()}{rng.choice(['ton', 'ville', 'burg', 'port', 'field'])}"
        country = rng.choice(["Norland", "Estavia", "Corvinia", "Baltoria"])
        pop = rng.randrange(20, 3000) * 1000
        area = round(rng.uniform(20, 900), 1)
        sights = rng.sample(WORDS, 3)
        text = (f"{name} is a city in {country}. It has a population of {pop} and covers {area} square kilometres. "
                + " ".join(f"The {w} district is known for its {words(rng, 8)}." for w in sights)
                + f" Visitors often mention the {sights[0]} bridge and the {sights[1]} market. "
                + " ".join(f"{words(rng, 10).capitalize()}." for _ in range(6)))
        docs.append({"document": text, "city": name, "country": country, "population": pop, "area": area})
    return {"documents": docs}


def rag(rng):
    docs = []
    for i in range(24):
        subject = WORDS[i]
        docs.append({"id": i, "title": f"The {subject} guide",
                     "text": f"The {subject} guide explains how the {subject} works. " + " ".join(
                         f"{words(rng, 9).capitalize()}." for _ in range(5))})
    questions = []
    for i in range(32):
        a, b = rng.sample(WORDS[:24], 2)
        questions.append({"question": f"How do the {a} and the {b} work together?"})
    return {"documents": docs, "questions": questions}


BUILDERS = {"mmlu": mmlu, "hellaswag": hellaswag, "react": react, "agents": agents, "gsm8k": gsm8k,
            "topics": topics, "articles": articles, "cities": cities, "rag": rag}


def main() -> None:
    DATA.mkdir(exist_ok=True)
    for i, (name, build) in enumerate(BUILDERS.items()):
        data = build(random.Random(1000 + i))
        (DATA / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    total = sum(f.stat().st_size for f in DATA.glob("*.json"))
    print(f"wrote {len(BUILDERS)} files, {total / 1024:.0f} KiB, to {DATA}")


if __name__ == "__main__":
    main()
