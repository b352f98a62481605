"""Reading an OpenAI-style server-sent-event stream in tests."""

from __future__ import annotations

import json


async def sse_events(response, drop_after_first: bool = False) -> tuple[list[dict], bool]:
    """The ``data:`` events of a streaming httpx response and whether ``[DONE]`` ended it. With
    ``drop_after_first`` it stops reading after the first event: the caller then leaves the stream
    block, which drops the connection mid-stream (a client that walks away)."""
    events, done = [], False
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
            if drop_after_first:
                break
    return events, done
