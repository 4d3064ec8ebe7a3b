"""Quickstart: the local engine on the embedded SmolLM2-135M-Instruct, with prefix caching visible.

    make example        # or: python examples/quickstart.py
"""
from lmc.runtime import Engine

engine = Engine()  # embedded default model; converted and cached on first use
tok = engine.tokenizer
few_shot = "".join(f"Q: What is the capital of {c}?\nA: {a}\n" for c, a in
                   [("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Egypt", "Cairo")])
questions = ["France", "Germany", "Canada", "Kenya"]
prompts = [f"{few_shot}Q: What is the capital of {q}?\nA:" for q in questions]
results = engine.generate(prompts, {"max_new_tokens": 6, "temperature": 0, "stop": "\n"})
for q, r in zip(questions, results):
    m = r["meta_info"]
    print(f"{q:8s} -> {r['text'].strip():12s} (prompt {m['prompt_tokens']} tokens, {m['cached_tokens']} from cache)")

chat = tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}], tokenize=False,
                               add_generation_prompt=True)
print(engine.generate(chat, {"max_new_tokens": 32, "temperature": 0})["text"])
print({k: v for k, v in engine.stats().items() if k in ("prompt_tokens", "cached_tokens", "forwards")})
engine.shutdown()
