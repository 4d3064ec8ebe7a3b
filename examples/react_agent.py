"""A ReAct agent: thought, action, observation, up to `max_steps` times. The action is a `select` over the tool
names and "finish"; Python reads it (`s["action"]`), calls the (fake) tool and appends the observation.

    python examples/react_agent.py
    lmc run examples/react_agent.py --arg question="What is the population of the capital of France?" \
        --temperature 0
"""
import lmc as sgl

TOOLS = {
    "capital": {"france": "Paris", "japan": "Tokyo", "italy": "Rome", "germany": "Berlin", "spain": "Madrid",
                "kenya": "Nairobi", "canada": "Ottawa", "egypt": "Cairo"},
    "population": {"paris": "2.1 million", "tokyo": "14 million", "rome": "2.8 million", "berlin": "3.7 million",
                   "madrid": "3.3 million", "nairobi": "4.4 million", "ottawa": "1.0 million", "cairo": "10 million",
                   "france": "68 million", "japan": "124 million", "italy": "59 million", "germany": "84 million"},
}
ACTIONS = [*TOOLS, "finish"]

PROMPT = """Answer the question using these tools:
capital[country] gives the capital city of a country.
population[place] gives the population of a city or a country.
finish[answer] gives the final answer.

Question: What is the population of the capital of Japan?
Thought 1: I need the capital of Japan first.
Action 1: capital[Japan]
Observation 1: Tokyo
Thought 2: Now I need the population of Tokyo.
Action 2: population[Tokyo]
Observation 2: 14 million
Thought 3: I know the answer.
Action 3: finish[14 million]

"""


def lookup(tool: str, arg: str) -> str:
    key = arg.strip().strip("\"'.").lower()
    return TOOLS[tool].get(key, f"no {tool} entry for {arg.strip()!r}")


@sgl.function
def react_agent(s, question, max_steps=3):
    s += PROMPT + "Question: " + question + "\n"
    steps = []
    for step in range(1, max_steps + 1):
        s += f"Thought {step}:" + sgl.gen("thought", max_tokens=24, stop="\n") + "\n"
        s += (f"Action {step}: " + sgl.select("action", choices=ACTIONS) + "["
              + sgl.gen("action_input", max_tokens=12, stop=["]", "\n"]) + "]\n")
        action, arg = s["action"], s["action_input"].strip()  # waits for the model's choice
        if action == "finish":
            steps.append({"action": action, "input": arg})
            s["answer"] = arg
            break
        observation = lookup(action, arg)
        steps.append({"action": action, "input": arg, "observation": observation})
        s += f"Observation {step}: {observation}\n"
    else:  # out of steps: ask for the answer directly
        s += "Final answer:" + sgl.gen("answer", max_tokens=16, stop="\n")
    s["steps"] = steps


if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    for q in ("What is the capital of Italy?", "What is the population of the capital of France?"):
        state = react_agent.run(question=q, temperature=0)
        print(q)
        for i, st in enumerate(state["steps"], 1):
            print(f"  {i}. {st['action']}[{st['input']}]" + (f" -> {st['observation']}" if "observation" in st else ""))
        print("  answer:", state["answer"].strip())
