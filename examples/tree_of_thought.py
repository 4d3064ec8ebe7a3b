"""A small tree of thought: propose a few thoughts in parallel forks (each opened with a different approach),
score each with a yes/no `select` on its correctness, then expand the best one into an answer. Python reads the
scores (the select's per-choice logprobs, from get_meta_info) to pick the branch.

    python examples/tree_of_thought.py
    lmc run examples/tree_of_thought.py --arg question="What is 2 + 3?" --temperature 0
"""
import lmc as sgl

APPROACHES = ["Let's think step by step.", "Let's start from what we know.", "Let's compare the options."]


@sgl.function
def tree_of_thought(s, question, num_thoughts=3):
    s += sgl.system("You are a careful problem solver.")
    s += sgl.user(question)
    forks = s.fork(num_thoughts)
    for approach, f in zip(APPROACHES, forks):
        f += sgl.assistant(approach + sgl.gen("thought", max_tokens=32, stop="\n\n"))
        f += sgl.user("Is the reasoning above correct? Answer yes or no.")
        f += sgl.assistant(sgl.select("correct", choices=["yes", "no"]))
    forks.join()  # s["thought"] and s["correct"]: one entry per branch

    # A thought's score: how much more likely "yes" is than "no" (mean token logprobs of the two choices).
    metas = s.get_meta_info("correct")
    s["scores"] = scores = [round(m["normalized_prompt_logprobs"][0] - m["normalized_prompt_logprobs"][1], 3)
                            for m in metas]
    s["best"] = best = max(range(len(scores)), key=lambda i: scores[i])
    s += sgl.assistant(APPROACHES[best] + s["thought"][best].rstrip() + sgl.gen("expansion", max_tokens=32))
    s += sgl.user("So what is the final answer? Answer in one short sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=24))


if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    state = tree_of_thought.run(question="What is 2 + 3?", temperature=0)
    for i, (thought, score) in enumerate(zip(state["thought"], state["scores"])):
        print(f"{'*' if i == state['best'] else ' '} [{score:+.3f}] {APPROACHES[i]}{thought.rstrip()}")
    print("Expansion:", state["expansion"].strip())
    print("Answer:", state["answer"].strip())
