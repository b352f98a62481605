"""One HTTP generation request's view of its engine requests: the JSON response or the SSE stream.

A chat request with tools gets the model's tool calls parsed into ``message.tool_calls`` (streamed:
content up to the first call's marker as it comes, then the calls as ``delta.tool_calls`` once the
choice ends) and ``finish_reason: "tool_calls"``. A choice cut by max_tokens stays "length".

A choice the engine failed (finish_reason "error") fails its HTTP request alone: a 500 error
object, or in a stream (whose 200 is already sent) an in-band ``data: {"error": ...}`` event and
``[DONE]``; the request's other choices are aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging

from .protocol import APIError, GenRequest, chat_logprobs, completion_logprobs, now, usage
from .tool_calls import content_before_marker
from .trace import stream_delay_record

log = logging.getLogger("infer.server")


class Generation:
    """One HTTP request's view of its engine requests: gathers outputs, builds the response or stream."""

    def __init__(self, state, req: GenRequest, rid: str, sub_ids: list[str], queue: asyncio.Queue):
        self.state = state
        self.req = req
        self.rid = rid
        self.sub_ids = sub_ids
        self.index = {s: i for i, s in enumerate(sub_ids)}
        self.queue = queue
        self.created = now()
        self.final: dict[int, tuple] = {}
        self.done = False

    def abort_unfinished(self) -> None:
        runner = self.state.loop_runner
        for sub, i in self.index.items():
            if i not in self.final:
                runner.abort(sub)

    async def _next(self):
        return self._checked(await self.queue.get())

    def _checked(self, item):
        """An output, or the error it carries raised as the APIError this request answers with."""
        if isinstance(item, APIError):
            raise item
        if isinstance(item, Exception):
            raise APIError(500, f"engine error: {type(item).__name__}: {item}", type="server_error",
                           code="engine_error")
        out = item[0]
        if out.finish_reason == "error":
            choice = f" (choice {self.index[out.request_id]})" if len(self.sub_ids) > 1 else ""
            if out.error_by_request:
                raise APIError(400, f"generation stopped{choice}: {out.error}", code="no_allowed_token")
            raise APIError(500, f"generation failed{choice}: {out.error}", type="server_error",
                           code="generation_error")
        return item

    def _usage(self) -> dict:
        req = self.req
        prompt = sum(len(p) for p in req.prompts)
        completion = 0 if req.discard_output else sum(len(o.token_ids) for o, _ in self.final.values())
        cached = sum(f.num_cached_tokens for _, f in self.final.values() if f) // max(1, req.n)
        return usage(prompt, completion, cached)

    def _text_and_logprobs(self, out, i: int, prompt_part: bool, start_tok: int, end_tok: int, text: str):
        """Builds a choice's text and logprobs for tokens [start_tok, end_tok) of the output (plus the prompt)."""
        req, tt = self.req, self.state.token_text
        pidx = i // req.n
        entries = []
        prefix = ""
        if prompt_part and req.echo:
            ptxt = req.prompt_texts[pidx]
            prefix = ptxt if ptxt is not None else self.state.engine.tokenizer.decode(req.prompts[pidx])
            if req.logprobs is not None:
                plp = out.prompt_logprobs or []
                entries += [(t, plp[k] if k < len(plp) else None) for k, t in enumerate(req.prompts[pidx])]
        if req.discard_output:
            text = ""
            end_tok = start_tok
        if req.logprobs is not None and out.logprobs is not None:
            lps = out.logprobs
            entries += [(out.token_ids[k], lps[k] if k < len(lps) else None) for k in range(start_tok, end_tok)]
        lp = None
        if req.logprobs is not None:
            if req.kind == "chat":
                lp = chat_logprobs(entries, tt)
            else:
                base = 0 if req.echo else len(req.prompt_texts[pidx] or "")
                lp = completion_logprobs(entries, tt, base)
        return prefix + text, lp

    # ------------------------------------------------------------------ not streaming
    async def collect(self, request) -> dict:
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            while len(self.final) < len(self.sub_ids):
                getter = asyncio.ensure_future(self._next())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return None
                out, fin, _ = getter.result()
                if out.finished:
                    self.final[self.index[out.request_id]] = (out, fin)
        finally:
            watcher.cancel()
            self.abort_unfinished()
        self._log_outputs()
        choices = []
        for i in range(len(self.sub_ids)):
            out, fin = self.final[i]
            text, lp = self._text_and_logprobs(out, i, True, 0, len(out.token_ids), out.text)
            c = {"index": i, "logprobs": lp, "finish_reason": out.finish_reason}
            if self.req.kind == "chat":
                c["message"] = {"role": "assistant", "content": text}
                content, calls = self._tool_calls(out, text)
                if calls:
                    c["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    c["finish_reason"] = "tool_calls"
            else:
                c["text"] = text
            c["metrics"] = fin.as_dict() if fin else None
            choices.append(c)
        return {"id": self.rid, "object": "chat.completion" if self.req.kind == "chat" else "text_completion",
                "created": self.created, "model": self.state.name, "choices": choices, "usage": self._usage(),
                "system_fingerprint": f"infer-{self.state.version}"}

    def _tool_calls(self, out, text: str) -> tuple[str | None, list[dict]]:
        """The choice's tool calls (none unless the request had tools and the choice ended by itself)."""
        if self.req.tool_format is None or out.finish_reason != "stop":
            return text, []
        return self.req.tool_format.parse(text)

    def _log_outputs(self) -> None:
        if self.state.config.log_requests:
            for i, (out, _) in sorted(self.final.items()):
                log.info("request %s choice %d (%s): %r", self.rid, i, out.finish_reason, out.text)

    # ------------------------------------------------------------------ streaming
    def _chunk(self, choices: list[dict], **extra) -> str:
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.req.kind == "chat" else "text_completion",
               "created": self.created, "model": self.state.name, "choices": choices, **extra}
        if self.req.include_usage and "usage" not in obj:
            obj["usage"] = None
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream(self):
        req = self.req
        chat = req.kind == "chat"
        emitted = [0] * len(self.sub_ids)  # tokens already sent per choice
        started = [False] * len(self.sub_ids)
        said = [""] * len(self.sub_ids)  # with tools: the text so far, and how much went out as content
        sent = [0] * len(self.sub_ids)
        trace = self.state.trace
        try:
            if chat:
                yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None} for i in range(len(self.sub_ids))])
                started = [True] * len(self.sub_ids)
            while len(self.final) < len(self.sub_ids):
                items = [await self._next()]
                while not self.queue.empty():  # a slow reader gets what piled up as one chunk per choice
                    items.append(self._checked(self.queue.get_nowait()))
                merged: dict[int, list] = {}
                produced = min(item[2] for item in items)  # the oldest output this chunk carries
                for out, fin, _ in items:
                    i = self.index[out.request_id]
                    if i in merged:
                        merged[i][1] += out.delta_text
                        merged[i][0], merged[i][2] = out, fin
                    else:
                        merged[i] = [out, out.delta_text, fin]
                choices, finals = [], []
                for i, (out, text, fin) in sorted(merged.items()):
                    first = not started[i]
                    started[i] = True
                    end = len(out.token_ids)
                    text, lp = self._text_and_logprobs(out, i, first, emitted[i], end, text)
                    emitted[i] = end
                    if out.finished:
                        self.final[i] = (out, fin)
                    if chat:
                        reason, calls = out.finish_reason, []
                        if req.tool_format is not None:  # content stops where a call begins; calls at the end
                            said[i] += text
                            if out.finished:
                                content, calls = self._tool_calls(out, said[i])
                                reason = "tool_calls" if calls else reason
                                shown = said[i] if not calls else (content or "")
                            else:
                                shown = content_before_marker(said[i], req.tool_format.marker)
                            text = shown[sent[i]:] if shown.startswith(said[i][:sent[i]]) else ""
                            sent[i] = max(sent[i], len(shown))
                        if text or lp or calls:
                            delta = {"content": text}
                            if calls:
                                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                            choices.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": None})
                        if out.finished:  # its own chunk, after the last content, as OpenAI sends it
                            c = {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
                            c["metrics"] = fin.as_dict() if fin else None
                            finals.append(c)
                    elif text or lp or out.finished:
                        c = {"index": i, "text": text, "logprobs": lp,
                             "finish_reason": out.finish_reason if out.finished else None}
                        if out.finished:
                            c["metrics"] = fin.as_dict() if fin else None
                        choices.append(c)
                if choices:
                    yield self._chunk(choices)  # resumes once the chunk is written
                    if trace is not None:
                        trace.add(stream_delay_record(produced, len(items)))
                if finals:
                    yield self._chunk(finals)
            if req.include_usage:
                yield self._chunk([], usage=self._usage())
            self._log_outputs()
            yield "data: [DONE]\n\n"
        except Exception as e:  # the 200 is sent: say so in-band, then end
            if not isinstance(e, APIError):
                log.exception("request %s: building its stream failed", self.rid)
                e = APIError(500, f"internal error: {type(e).__name__}", type="server_error")
            log.error("request %s failed: %s", self.rid, e.message)
            yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also runs when the client disconnects (the generator is cancelled)
            self.abort_unfinished()


async def wait_disconnect(request) -> None:
    """Returns when the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
