"""Server-sent events and the OpenAI-compatible streaming protocol, for Server adapters.

``OpenAICompatibleServer`` streams /v1/completions or /v1/chat/completions with usage, maps
HTTP and in-band errors to failure causes, and reads Prometheus metrics; engine adapters
(vLLM, transformers serve, any OpenAI-compatible URL) subclass it and add start/stop.
"""

from __future__ import annotations

import json
import os
from typing import Any, AsyncIterator

from .interfaces import Server
from .serving import Chunk, PlannedRequest, RequestFailed


async def sse_events(response) -> AsyncIterator[str]:
    """The data payloads of an SSE stream; comment lines (':' keep-alives) and other fields are skipped."""
    data: list[str] = []
    async for raw in response.content:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def http_failure(status: int, body: str) -> RequestFailed:
    cause = "http_429" if status == 429 else "http_5xx" if status >= 500 else "http_4xx"
    return RequestFailed(cause, f"HTTP {status}: {body[:300]}")


def parse_prometheus(text: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """Samples whose metric name starts with one of ``prefixes``, keyed by name{labels}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(prefixes):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


class OpenAICompatibleServer(Server):
    """Streams the OpenAI API. ``model_name`` is what the engine calls the model; the API key, if any,
    comes from the environment variable named by ``api_key_env`` and never enters a record or a log."""

    api_key_env = "OPENAI_API_KEY"
    metrics_prefixes: tuple[str, ...] = ()
    supports_ignore_eos = False

    @property
    def forces_output_length(self) -> bool:
        return self.supports_ignore_eos

    def model_name(self) -> str:
        return str(self.ctx.checkpoint) if self.ctx.checkpoint else "default"

    def headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def payload(self, request: PlannedRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model_name(), "max_tokens": request.output_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0,
        }
        if request.ignore_eos and self.supports_ignore_eos:
            body["ignore_eos"] = True
        if request.api == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
            return "/v1/chat/completions", body
        body["prompt"] = request.prompt
        return "/v1/completions", body

    async def ready(self, session) -> bool:
        async with session.get(self.ctx.base_url + "/health", headers=self.headers()) as r:
            return r.status == 200

    async def stream(self, session, request: PlannedRequest) -> AsyncIterator[Chunk]:
        path, body = self.payload(request)
        async with session.post(self.ctx.base_url + path, json=body, headers=self.headers()) as response:
            if response.status != 200:
                raise http_failure(response.status, await response.text())
            async for data in sse_events(response):
                if data.strip() == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    raise RequestFailed("malformed", f"not JSON in the stream: {data[:200]!r}") from None
                if "error" in event:
                    raise RequestFailed("in_band", f"error event: {str(event['error'])[:300]}")
                yield self.parse_event(event)

    def parse_event(self, event: dict[str, Any]) -> Chunk:
        usage = event.get("usage") or {}
        text, finish = "", None
        for choice in event.get("choices") or []:
            delta = choice.get("delta")
            text += (delta.get("content") or "") if delta is not None else (choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
        return Chunk(text=text, tokens=None, finish_reason=finish,
                     usage_output_tokens=usage.get("completion_tokens"), usage_input_tokens=usage.get("prompt_tokens"))

    async def scrape(self, session) -> dict[str, float]:
        if not self.metrics_prefixes:
            return {}
        async with session.get(self.ctx.base_url + "/metrics", headers=self.headers()) as r:
            if r.status != 200:
                return {}
            return parse_prometheus(await r.text(), self.metrics_prefixes)
