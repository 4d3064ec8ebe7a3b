"""A two-turn chat: system, user and assistant roles in the model's own chat template.

    python examples/multi_turn_chat.py
    lmc run examples/multi_turn_chat.py --arg question_1="What is the capital of France?" \
        --arg question_2="What language do people speak there?" --temperature 0
"""
import lmc as sgl


@sgl.function
def multi_turn_chat(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=48))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=48))


if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    state = multi_turn_chat.run(question_1="What is the capital of France?",
                                question_2="What language do people speak there?", temperature=0)
    for m in state.messages():
        print(f"{m['role']:>9}: {m['content']}")
