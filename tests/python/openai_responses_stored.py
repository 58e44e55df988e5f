"""A conversation kept on the server, through the gateway, with the official OpenAI Python SDK.

Run by tests/tests/openai_sdk.rs. The first round sends `instructions` and the task; every later
round sends only the new user message and `previous_response_id` (the id of the round before),
with the `tools` list again and `store=True`, so the server must rebuild the conversation from
what it stored. Rounds alternate JSON and a stream of typed events. Prints one JSON object per round:
{"round": n, "stream": bool, "upstream": "ip:port", "id": "resp_...", "answer": "...",
"cached_tokens": n}. The base URL comes from GATEWAY_BASE_URL (e.g. http://127.0.0.1:1234/v1).
"""

import json
import os
import sys

import openai
from sdk_responses import TOOLS, create

base_url = os.environ["GATEWAY_BASE_URL"]
model = os.environ.get("MODEL", "meta-llama/Llama-3.1-8B-Instruct")
task = os.environ.get("TASK", "The build fails on the CI; find out why and fix it.")
rounds = int(os.environ.get("ROUNDS", "6"))
client = openai.OpenAI(base_url=base_url, api_key="not-needed", timeout=10.0, max_retries=0)

previous = None
for round_ in range(rounds):
    request = dict(model=model, max_output_tokens=32, store=True, tools=TOOLS)
    if previous is None:
        request["instructions"] = "You are a coding agent."
        request["input"] = task
    else:
        request["previous_response_id"] = previous
        request["input"] = [
            {"role": "user", "content": f"Round {round_}: the tests still fail. Go on."}
        ]
    stream = round_ % 2 == 1
    try:
        upstream, answer, response = create(client, stream, **request)
    except openai.APIStatusError as e:
        sys.exit(f"round {round_} failed: {e.status_code} {e.message}")
    print(
        json.dumps(
            {
                "round": round_,
                "stream": stream,
                "upstream": upstream,
                "id": response.id,
                "answer": answer,
                "cached_tokens": response.usage.input_tokens_details.cached_tokens,
            }
        ),
        flush=True,
    )
    previous = response.id
sys.exit(0)
