"""A ReAct loop with a Python tool (in the style of SGLang's ReAct benchmark program): the model thinks, picks an
action with `select`, writes the tool's input; Python runs the tool (an arithmetic evaluator) on the generated
text and appends its result as the observation, until the model picks "finish" or the step limit is reached.

Compiled, every tool call is a graph break: the segment up to it runs as a plan, the tool runs on the concrete
text, and tracing resumes after it (`lmc compile examples/calculator_agent.py` lists the breaks).

    python examples/calculator_agent.py
    lmc run examples/calculator_agent.py --arg question="What is 12 times 7, plus 5?" --temperature 0
"""
import ast
import operator

import lmc as sgl

ACTIONS = ["calculate", "finish"]

PROMPT = """Answer the question. Use calculate[expression] to compute, then finish[answer].

Question: What is 6 times 7, minus 2?
Thought 1: First I compute 6 times 7 minus 2.
Action 1: calculate[6 * 7 - 2]
Observation 1: 40
Thought 2: I know the answer.
Action 2: finish[40]

"""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The tool: evaluate + - * / over numbers (no names, no calls), or say why not."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / are allowed")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


@sgl.function
def calculator_agent(s, question, max_steps=3):
    s += PROMPT + "Question: " + question + "\n"
    for step in range(1, max_steps + 1):
        s += f"Thought {step}:" + sgl.gen("thought", max_tokens=24, stop="\n") + "\n"
        s += (f"Action {step}: " + sgl.select("action", choices=ACTIONS) + "["
              + sgl.gen("action_input", max_tokens=16, stop=["]", "\n"]) + "]\n")
        if s["action"] == "finish":
            break
        s += f"Observation {step}: {calculate(s['action_input'])}\n"  # the tool runs on the generated text
    s["answer"] = s["action_input"].strip()


if __name__ == "__main__":
    sgl.set_default_backend(sgl.Local())
    state = calculator_agent.compile().run(question="What is 12 times 7, plus 5?", temperature=0)
    print(state.text()[len(PROMPT):])
    print("answer:", state["answer"])
