"""Server-sent events and the OpenAI-compatible streaming protocol, for Server adapters.

``OpenAICompatibleServer`` streams /v1/completions or /v1/chat/completions with usage, maps
HTTP and in-band errors to failure causes, and reads Prometheus metrics; engine adapters
(vLLM, transformers serve, any OpenAI-compatible URL) subclass it and add start/stop.
"""

from __future__ import annotations

import json
import os
from typing import Any, AsyncIterator

from llmadapt.adapter.context import Chunk, PlannedRequest, RequestFailed, WrongServer
from llmadapt.adapter.interfaces import Server


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


def excerpt(value: Any, limit: int = 200) -> str:
    """A short, one-line quote of what a server sent, for error texts."""
    text = value if isinstance(value, str) else json.dumps(value)
    return repr(" ".join(text.split())[:limit])


def _kind(value: Any) -> str:
    """A JSON value's type, as a reader of the protocol names it."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "text", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def malformed(field: str, value: Any, expected: str, event: Any) -> RequestFailed:
    return RequestFailed("malformed", f"malformed response: {field} is {_kind(value)}, not {expected}: "
                                      f"{excerpt(event)}")


def json_event(data: str) -> dict[str, Any]:
    """One SSE data payload as a JSON object. Anything else (not JSON; a list, null, a number) is a malformed
    response, never a connection failure."""
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        raise RequestFailed("malformed", f"not JSON in the stream: {excerpt(data)}") from None
    if not isinstance(event, dict):
        raise malformed("the event", event, "an object", data)
    return event


_EXPECTED = {str: "text", dict: "an object", list: "a list", int: "a count"}


def field(obj: dict[str, Any], key: str, kind: type, where: str, event: Any) -> Any:
    """``obj[key]`` if absent, null or of the protocol's type; else the request fails as malformed. What a
    server sends ends up in request records, and a value of the wrong type there would make llmadapt's own
    summary step refuse the whole trace. Counts are non-negative integers (a boolean is not one)."""
    value = obj.get(key)
    if value is None:
        return None
    if kind is int:
        if type(value) is int and value >= 0:
            return value
    elif isinstance(value, kind):
        return value
    raise malformed(where, value, _EXPECTED[kind], event)


def http_failure(status: int, body: str) -> RequestFailed:
    cause = "http_429" if status == 429 else "http_5xx" if status >= 500 else "http_4xx"
    return RequestFailed(cause, f"HTTP {status}: {body[:300]}")


def parse_prometheus(text: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """Samples whose series name starts with one of ``prefixes``, keyed by ``name{labels}``.

    Read with prometheus_client's parser (the exposition format: labels, escapes, timestamps); a line it
    cannot read is skipped, so one odd metric does not cost the others.
    """
    from prometheus_client.parser import text_string_to_metric_families

    def samples(chunk: str):
        try:
            for family in text_string_to_metric_families(chunk):
                yield from family.samples
        except ValueError:
            if "\n" in chunk.strip():  # one bad line: read the others one by one
                for line in chunk.splitlines():
                    if line and not line.startswith("#"):
                        yield from samples(line + "\n")

    # Without its TYPE lines every series is read untyped, so it keeps the name the engine printed: typed,
    # the parser renames a counter's samples to NAME_total (OpenMetrics), which TGI's counters are not.
    text = "\n".join(line for line in text.splitlines() if not line.startswith("# TYPE")) + "\n"
    out: dict[str, float] = {}
    for sample in samples(text):
        if sample.name.startswith(prefixes):
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Ending:
    """The end marker of an OpenAI-style stream: a choice's finish reason (then ``data: [DONE]``, which not every
    OpenAI-compatible server sends: transformers serve does not). A stream that ends without a finish reason (a proxy
    or an engine that closed it early, cleanly) may be cut short: the request is 'truncated' (RequestFailed cause),
    never a completed response. ``done_required``: the engine's protocol always ends with [DONE] (TGI), so a
    stream without it is truncated too."""

    def __init__(self, done_required: bool = False) -> None:
        self.finish: str | None = None
        self.done_required = done_required

    def seen(self, chunk: Chunk) -> Chunk:
        self.finish = chunk.finish_reason or self.finish
        return chunk

    def done(self, marker: bool = True) -> None:
        if not self.finish:
            raise RequestFailed("truncated", "truncated: the stream ended " + ("(data: [DONE]) " if marker else "")
                                + "without a finish reason" + ("" if marker else " or data: [DONE]"))
        if not marker and self.done_required:
            raise RequestFailed("truncated", "truncated: the stream ended without data: [DONE]")


class OpenAICompatibleServer(Server):
    """Streams the OpenAI API. ``model_name`` is what the engine calls the model; the API key, if any,
    comes from the environment variable named by ``api_key_env`` and never enters a record or a log."""

    api_key_env = "OPENAI_API_KEY"
    metrics_prefixes: tuple[str, ...] = ()
    supports_ignore_eos = False
    done_required = False
    """The engine's streams always end with ``data: [DONE]`` (TGI's do): one that ends without it is truncated."""

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

    async def list_models(self, session) -> list[dict[str, Any]] | None:
        """GET /v1/models: the model list, or None while the server answers but is not ready (not 200).

        A 200 that is not the OpenAI list (an HTML page, other JSON) raises WrongServer: whatever answers there
        is not an OpenAI-compatible server, and waiting for it would only hide that."""
        async with session.get(self.ctx.base_url + "/v1/models", headers=self.headers()) as r:
            if r.status != 200:
                return None
            text = await r.text(errors="replace")
            kind = r.content_type
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        models = body.get("data") if isinstance(body, dict) else None
        if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                   for m in models):
            raise WrongServer(f"the server at {self.ctx.base_url} is not an OpenAI-compatible server: GET /v1/models "
                              f"answered 200 ({kind}) {excerpt(text, 120)}, not a model list")
        return models

    async def stream(self, session, request: PlannedRequest) -> AsyncIterator[Chunk]:
        path, body = self.payload(request)
        async with session.post(self.ctx.base_url + path, json=body, headers=self.headers()) as response:
            if response.status != 200:
                raise http_failure(response.status, await response.text())
            ended = Ending(self.done_required)
            async for data in sse_events(response):
                if data.strip() == "[DONE]":
                    ended.done()
                    return
                event = json_event(data)
                if "error" in event:
                    raise self.in_band_error(event)
                yield ended.seen(self.parse_event(event))
            ended.done(marker=False)

    def in_band_error(self, event: dict[str, Any]) -> RequestFailed:
        """The failure an error event in the stream (``{"error": ...}``) stands for."""
        return RequestFailed("in_band", f"error event: {str(event['error'])[:300]}")

    def parse_event(self, event: dict[str, Any]) -> Chunk:
        """One chunk of /v1/completions or /v1/chat/completions; fields of the wrong type fail it as malformed."""
        usage = field(event, "usage", dict, "usage", event) or {}
        text, finish = "", None
        for i, choice in enumerate(field(event, "choices", list, "choices", event) or []):
            if not isinstance(choice, dict):
                raise malformed(f"choices[{i}]", choice, "an object", event)
            delta = field(choice, "delta", dict, f"choices[{i}].delta", event)
            if delta is not None:
                text += field(delta, "content", str, f"choices[{i}].delta.content", event) or ""
            else:
                text += field(choice, "text", str, f"choices[{i}].text", event) or ""
            finish = field(choice, "finish_reason", str, f"choices[{i}].finish_reason", event) or finish
        return Chunk(text=text, tokens=None, finish_reason=finish,
                     usage_output_tokens=field(usage, "completion_tokens", int, "usage.completion_tokens", event),
                     usage_input_tokens=field(usage, "prompt_tokens", int, "usage.prompt_tokens", event))

    async def scrape(self, session) -> dict[str, float]:
        if not self.metrics_prefixes:
            return {}
        async with session.get(self.ctx.base_url + "/metrics", headers=self.headers()) as r:
            if r.status != 200:
                return {}
            return parse_prometheus(await r.text(), self.metrics_prefixes)
