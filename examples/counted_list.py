"""A generated count driving a loop: the model says how many items a list needs (a constrained integer), then
the program writes that many items, one gen each, and a closing sentence.

Compiled, `int(s["count"])` is a graph break: the count is read, tracing resumes, and the loop unrolls to the
generated number of items (instances whose count is the same reuse that segment).

    python examples/counted_list.py
    lmc run examples/counted_list.py --arg topic="fruits" --temperature 0
"""
import lmc as sgl


@sgl.function
def counted_list(s, topic):
    s += sgl.user(f"How many {topic} should a short list of {topic} have? Answer with one number from 2 to 4.")
    s += sgl.assistant(sgl.gen("count", max_tokens=2, regex="[2-4]"))
    s += sgl.user("List them, one per line.")
    with s.assistant():
        for i in range(int(s["count"])):  # the loop's trip count is generated
            s += f"{i + 1}." + sgl.gen(f"item_{i + 1}", max_tokens=8, stop="\n") + "\n"
    s += sgl.user("Which one do you like most? Answer in a few words.")
    s += sgl.assistant(sgl.gen("favourite", max_tokens=12, stop="\n"))


if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    for topic in ("fruits", "colors"):
        state = counted_list.compile().run(topic=topic, temperature=0)
        print(topic, [state[f"item_{i + 1}"].strip() for i in range(int(state["count"]))], state["favourite"])
