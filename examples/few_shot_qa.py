"""Few-shot question answering: a handful of solved examples, then the question; the answer stops at the line end.

    python examples/few_shot_qa.py
    lmc run examples/few_shot_qa.py --arg question="What is the capital of Germany?" --temperature 0
"""
import lmc as sgl

EXAMPLES = [("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"), ("Canada", "Ottawa")]


@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    for country, capital in EXAMPLES:
        s += f"Q: What is the capital of {country}?\nA: {capital}\n\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", max_tokens=16, stop="\n")


if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    questions = [f"What is the capital of {c}?" for c in ("France", "Germany", "Spain", "Kenya")]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], temperature=0)
    for q, state in zip(questions, states):
        print(f"{q:35s} -> {state['answer'].strip()}")
