"""A multi-dimension judge: one fork per dimension (all sharing the question and answer as a cached prefix), a
`select` score and a short reason in each, joined with gather_variable, then an overall verdict.

    python examples/judge.py
    lmc run examples/judge.py --arg question="What is the capital of France?" --arg answer="Paris." --json
"""
import lmc as sgl

DIMENSIONS = {
    "clarity": "is it clear and easy to understand?",
    "accuracy": "is it factually correct?",
    "relevance": "does it answer the question that was asked?",
}
SCORES = ["1", "2", "3", "4", "5"]


@sgl.function
def judge(s, question, answer):
    s += sgl.system("You are a strict judge of answers to questions.")
    s += sgl.user_begin() + f"Question: {question}\nAnswer: {answer}\n\n"  # the user turn stays open for the forks
    forks = s.fork(len(DIMENSIONS))
    for f, (dim, desc) in zip(forks, DIMENSIONS.items()):
        f += f"Rate the answer's {dim} ({desc}) on a scale from 1 to 5." + sgl.user_end()
        f += sgl.assistant(f"I rate the {dim} of the answer " + sgl.select("score", choices=SCORES)
                           + " out of 5, because" + sgl.gen("reason", max_tokens=24, stop="\n"))
    forks.join()  # s["score"] and s["reason"]: one entry per dimension

    s["scores"] = {dim: int(x) for dim, x in zip(DIMENSIONS, s["score"])}
    summary = "\n".join(f"- {dim}: {x}/5" for dim, x in s["scores"].items())
    s += f"Scores:\n{summary}\nOverall, is this a good answer? Answer yes or no." + sgl.user_end()
    s += sgl.assistant(sgl.select("verdict", choices=["yes", "no"]))


if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    for answer in ("The capital of France is Paris.", "The capital of France is Berlin."):
        state = judge.run(question="What is the capital of France?", answer=answer, temperature=0)
        print(f"{answer!r}: verdict={state['verdict']}")
        for (dim, score), reason in zip(state["scores"].items(), state["reason"]):
            print(f"  {dim:9s} {score}/5  {reason.strip()}")
