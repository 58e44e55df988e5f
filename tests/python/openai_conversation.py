"""A multi-turn conversation through the gateway with the official OpenAI Python SDK.

Run by tests/tests/openai_sdk.rs. Prints one JSON object per turn:
{"turn": n, "stream": bool, "upstream": "ip:port", "answer": "..."}.
The base URL comes from GATEWAY_BASE_URL (e.g. http://127.0.0.1:1234/v1).
"""

import json
import os
import sys

import openai

base_url = os.environ["GATEWAY_BASE_URL"]
model = os.environ.get("MODEL", "meta-llama/Llama-3.1-8B-Instruct")
client = openai.OpenAI(base_url=base_url, api_key="not-needed", timeout=10.0, max_retries=0)

messages = [{"role": "system", "content": "You are a helpful assistant for release planning."}]
questions = [
    "List the steps to cut a release branch.",
    "Which of those steps can be automated?",
    "Write the CI job for the first automated step.",
    "Now add a rollback step.",
]
for turn, question in enumerate(questions, start=1):
    messages.append({"role": "user", "content": question})
    stream = turn % 2 == 0
    if stream:
        with client.chat.completions.with_streaming_response.create(
            model=model, messages=messages, stream=True, max_tokens=32
        ) as raw:
            upstream = raw.headers.get("x-gateway-upstream-host")
            answer = ""
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    answer += chunk.choices[0].delta.content
    else:
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=32)
        upstream = raw.headers.get("x-gateway-upstream-host")
        answer = raw.parse().choices[0].message.content
    messages.append({"role": "assistant", "content": answer})
    print(json.dumps({"turn": turn, "stream": stream, "upstream": upstream, "answer": answer}), flush=True)
sys.exit(0)
