"""A coding agent on OpenAI's Responses API through the gateway, with the official OpenAI Python SDK.

Run by tests/tests/openai_sdk.rs. Each round sends `instructions` and the whole `input` list (the
model's output items appended as the SDK returns them, then a function call and its output, as an
agent loop does), alternately as JSON and as a stream of typed events. Prints one JSON object per
round: {"round": n, "stream": bool, "upstream": "ip:port", "answer": "...", "cached_tokens": n}.
The base URL comes from GATEWAY_BASE_URL (e.g. http://127.0.0.1:1234/v1).
"""

import json
import os
import sys

import openai
from sdk_responses import TOOLS, create

base_url = os.environ["GATEWAY_BASE_URL"]
model = os.environ.get("MODEL", "meta-llama/Llama-3.1-8B-Instruct")
task = os.environ.get("TASK", "The build fails on the CI; find out why and fix it.")
client = openai.OpenAI(base_url=base_url, api_key="not-needed", timeout=10.0, max_retries=0)

request = dict(
    model=model,
    instructions="You are a coding agent. Use run_command to inspect and fix the repository.",
    tools=TOOLS,
    max_output_tokens=32,
    store=False,
)
input_items = [{"role": "user", "content": [{"type": "input_text", "text": task}]}]
for round_ in range(4):
    stream = round_ % 2 == 1
    upstream, answer, response = create(client, stream, input=input_items, **request)
    cached = response.usage.input_tokens_details.cached_tokens
    print(
        json.dumps(
            {
                "round": round_,
                "stream": stream,
                "upstream": upstream,
                "answer": answer,
                "cached_tokens": cached,
            }
        ),
        flush=True,
    )
    # The agent loop: the model's output items as the SDK returned them, then the tool's run.
    input_items += [item.model_dump(exclude_none=True) for item in response.output]
    call_id = f"call_{round_}"
    input_items.append(
        {
            "type": "function_call",
            "call_id": call_id,
            "name": "run_command",
            "arguments": json.dumps({"command": "make test"}),
        }
    )
    input_items.append(
        {
            "type": "function_call_output",
            "call_id": call_id,
            "output": f"exit status 2: {3 + round_} tests failed",
        }
    )
sys.exit(0)
