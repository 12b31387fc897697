"""An agent written against the `openai` package and nothing else: multi-turn, one tool. It is
what a user brings; mmrl trains it through the rollout proxy without a change."""
import json

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "count_letters", "description": "Counts the letters of a text.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]


def count_letters(text: str) -> int:
    return sum(ch.isalpha() for ch in text)


def agent(base_url: str, sample: dict, turns: int = 2) -> dict:
    client = OpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "system", "content": "Answer with one colour word. You may count letters."}]
    messages += sample["messages"]
    answer = ""
    for _ in range(turns):
        reply = client.chat.completions.create(model="mmrl", messages=messages, tools=TOOLS, max_tokens=4)
        message = reply.choices[0].message
        answer = message.content or ""
        messages.append({"role": "assistant", "content": answer})
        # a random tiny model never writes a call itself: this agent uses its tool on every answer
        messages.append({"role": "tool", "tool_call_id": "count", "content": json.dumps({"letters": count_letters(answer)})})
    return {"answer": answer}
