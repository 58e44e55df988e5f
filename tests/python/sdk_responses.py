"""What the Responses API scripts share: one round as JSON or as a stream of typed events."""

import sys

# The agent's one tool, sent with every request (a stored response does not carry its tools
# over: agents send them again each round).
TOOLS = [
    {
        "type": "function",
        "name": "run_command",
        "description": "Run a shell command in the repository.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    }
]


def create(client, stream, **request):
    """Sends one Responses API request through the SDK; returns (upstream pod, answer text,
    response object). Streamed: the text of the deltas and the response of `response.completed`."""
    if not stream:
        raw = client.responses.with_raw_response.create(**request)
        response = raw.parse()
        return raw.headers.get("x-gateway-upstream-host"), response.output_text, response
    with client.responses.with_streaming_response.create(stream=True, **request) as raw:
        upstream = raw.headers.get("x-gateway-upstream-host")
        answer, response = "", None
        for event in raw.parse():
            if event.type == "response.output_text.delta":
                answer += event.delta
            elif event.type == "response.completed":
                response = event.response
    if response is None:
        sys.exit("the stream ended without response.completed")
    return upstream, answer, response
