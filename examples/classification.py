"""Classification with `select`: the label whose tokens the model finds most likely after the prompt.

    python examples/classification.py
    lmc run examples/classification.py --arg text="What a wonderful day!"
"""
import lmc as sgl

LABELS = ["positive", "negative"]


@sgl.function
def classify(s, text):
    s += sgl.user("Classify the sentiment of the sentence as positive or negative. Answer with one word.\n"
                  "Sentence: " + text)
    s += sgl.assistant(sgl.select("label", choices=LABELS))


if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    sentences = ["I love this movie, it was fantastic!", "This is the worst meal I have ever eaten.",
                 "The staff were friendly and the room was spotless.", "My phone broke after one day. Terrible."]
    states = classify.run_batch([{"text": t} for t in sentences], temperature=0)
    for text, state in zip(sentences, states):
        scores = state.get_meta_info("label")["normalized_prompt_logprobs"]
        print(f"{state['label']:8s} {dict(zip(LABELS, (round(x, 2) for x in scores)))}  {text}")
