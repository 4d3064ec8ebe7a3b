"""Structured extraction with API speculative execution (the SGLang paper's 3-field Wikipedia extraction): read a
short biography and fill Name / Birth date / Occupation, three gens that stop at the line end. On an API backend,
`num_api_spec_tokens` lets the first call over-generate and fill all three while the model follows the template
(one call instead of three); elsewhere it changes nothing.

    python examples/extraction.py
    lmc run examples/extraction.py --backend openai --base-url http://127.0.0.1:30000/v1 --model smollm2 \
        --arg doc="Ada Lovelace (10 December 1815 - 27 November 1852) was an English mathematician." --temperature 0
"""
import lmc as sgl

SHOTS = [("Steve Jobs (February 24, 1955 - October 5, 2011) was an American businessman, inventor, and investor "
          "best known for co-founding Apple.", "Steve Jobs", "February 24, 1955", "businessman"),
         ("Isaac Newton (25 December 1642 - 20 March 1727) was an English mathematician, physicist and astronomer.",
          "Isaac Newton", "25 December 1642", "mathematician"),
         ("Frida Kahlo (6 July 1907 - 13 July 1954) was a Mexican painter known for her many portraits.",
          "Frida Kahlo", "6 July 1907", "painter")]
INSTRUCTION = "Extract the name, birth date and occupation of the person in each text.\n\n"
EXAMPLES = "".join(f"Text: {t}\nName: {n}\nBirth date: {b}\nOccupation: {j}\n\n" for t, n, b, j in SHOTS)


def fields(s):
    s += "Name:" + sgl.gen("name", max_tokens=16, stop="\n") + "\nBirth date:" + \
        sgl.gen("birth", max_tokens=16, stop="\n") + "\nOccupation:" + sgl.gen("job", max_tokens=16, stop="\n")


def completion_body(s, doc):
    """For completion models: the solved examples, then the text, as one prompt."""
    s += INSTRUCTION + EXAMPLES + "Text: " + doc + "\n"
    fields(s)


def chat_body(s, doc):
    """For chat models: the examples in the user turn, the fields in the assistant's."""
    s += sgl.user(INSTRUCTION + "Answer in the format\nName: ...\nBirth date: ...\nOccupation: ...\n\n" + EXAMPLES
                  + "Text: " + doc)
    with s.assistant():
        fields(s)


extract = sgl.function(completion_body, num_api_spec_tokens=32)

if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    docs = ["Marie Curie (7 November 1867 - 4 July 1934) was a Polish physicist and chemist.",
            "Louis Pasteur (27 December 1822 - 28 September 1895) was a French chemist and microbiologist."]
    for state in extract.run_batch([{"doc": d} for d in docs], temperature=0):
        print({k: v.strip() for k, v in state.variables().items()})
