"""Skeleton of thought: write a skeleton of short tips, expand every tip in its own fork (the branches decode
together, sharing the prompt's cached prefix), join them, then summarise.

    python examples/tip_suggestion.py
    lmc run examples/tip_suggestion.py --arg topic="staying healthy" --arg num_tips=2 --temperature 0
"""
import lmc as sgl


@sgl.function
def tip_suggestion(s, topic, num_tips=3):
    s += sgl.user(f"Give {num_tips} short tips for {topic}. Write each tip in a few words.")
    s += sgl.assistant_begin()
    for i in range(1, num_tips + 1):  # the skeleton
        # No space after "1.": the model's words carry their own leading space (a trailing one derails it).
        s += f"{i}." + sgl.gen(f"tip_{i}", max_tokens=12, stop=["\n", ":", "."]) + "\n"
    s += sgl.assistant_end()
    s["tips"] = tips = [s[f"tip_{i}"].strip() for i in range(1, num_tips + 1)]

    forks = s.fork(num_tips)  # one branch per tip
    for i, (tip, f) in enumerate(zip(tips, forks), 1):
        f += sgl.user(f"Expand tip {i} into a short paragraph.")
        f += sgl.assistant(f"{tip}:" + sgl.gen("expansion", max_tokens=48))
    forks.join()  # gather_variable: s["expansion"] is the list of the branches' expansions

    details = "\n".join(f"- {tip}: {e.strip()}" for tip, e in zip(tips, s["expansion"]))
    s += sgl.user(f"Here are tips for {topic}:\n{details}\nSummarise these tips in one sentence.")
    s += sgl.assistant("In summary," + sgl.gen("summary", max_tokens=48))


if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    state = tip_suggestion.run(topic="staying healthy", temperature=0)
    for i, (tip, expansion) in enumerate(zip(state["tips"], state["expansion"]), 1):
        print(f"{i}. {tip}:{expansion}")
    print("In summary," + state["summary"])
