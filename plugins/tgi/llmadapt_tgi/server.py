"""The TGI Servers, attach-only: ``TGIServer`` (native /generate_stream) and ``TGIOpenAIServer`` (/v1 routes).

What TGI 3.3.x does on the wire (router/src/server.rs), and what these classes make of it:

- POST /generate_stream answers HTTP 200 with SSE, one ``data:`` event per generated token:
  ``{"index", "token": {"id", "text", "logprob", "special"}, "generated_text": null, "details": null}``;
  the last event has ``generated_text`` (the decoded text, special tokens skipped) and, when the
  request asked for ``details``, ``details: {"finish_reason", "generated_tokens", "seed",
  "input_length"}``. The stream then ends: no ``[DONE]``.
- Errors on a stream come in-band, still HTTP 200, as ``{"error": ..., "error_type": ...}`` events
  (validation, overloaded, generation, incomplete_generation), also after some tokens.
- Lines starting with ':' are keep-alive comments (axum's ``KeepAlive``), skipped by ``sse_events``.
- Omitted ``parameters`` take the router's defaults (``details`` false, so no usage); every field
  that matters is therefore sent explicitly.
- There is no ``ignore_eos``: the output length cannot be forced (``forces_output_length`` False).

Token accounting: every token event is one generated token, so each chunk says ``tokens=1``,
special tokens (EOS) included: TGI counts them in ``details.generated_tokens``, and the event
arrives after its own decode step. A special token's text (e.g. ``</s>``) is not content, so
the chunk's text is empty. Hence the sum of chunk tokens equals ``generated_tokens``, and a
response that ends with EOS has one more token-bearing chunk than it has visible text pieces.
"""

from __future__ import annotations

import json
import os
from typing import Any, AsyncIterator

import attrs

from llmadapt.adapter import Chunk, PlannedRequest, RequestFailed, Server
from llmadapt.adapter.sse import OpenAICompatibleServer, field, http_failure, json_event, parse_prometheus, sse_events

API_KEY_ENV = "TGI_API_KEY"
"""A TGI launched with --api-key wants ``Authorization: Bearer KEY``; the key comes from this variable only."""
METRICS_PREFIXES = ("tgi_",)
OPENAI_MODEL = "tgi"
"""TGI's OpenAI routes take any other ``model`` value as a LoRA adapter id (TGI PR #2128); "tgi" is the base model."""


def generate_parameters(request: PlannedRequest) -> dict[str, Any]:
    """TGI's GenerateParameters for one planned request, with every field that matters explicit."""
    return {
        "max_new_tokens": request.output_tokens,
        "details": True,  # the last event then carries finish_reason, generated_tokens and input_length
        "do_sample": False,  # greedy, never the router's default
        "return_full_text": False,
        "decoder_input_details": False,  # TGI refuses it on streams
        "watermark": False,
        "stop": [],
        "truncate": None,  # a prompt that is too long is a validation error, never silently cut
    }


def parse_stream_event(event: Any) -> tuple[Chunk, bool]:
    """One decoded /generate_stream event -> (chunk, is_last). Raises RequestFailed for error events."""
    if not isinstance(event, dict):
        raise RequestFailed("malformed", f"a stream event that is not an object: {json.dumps(event)[:200]}")
    if "error" in event:
        kind = event.get("error_type") or "error"
        raise RequestFailed("in_band", f"TGI {kind} error: {str(event['error'])[:300]}")
    token = event.get("token")
    if not isinstance(token, dict):
        raise RequestFailed("malformed", f"a stream event without a token: {json.dumps(event)[:200]}")
    text = "" if token.get("special") else field(token, "text", str, "token.text", event) or ""
    details = field(event, "details", dict, "details", event)
    last = event.get("generated_text") is not None or details is not None
    details = details or {}
    # these go into the request record: a value of another type there would cost the run its summary
    return Chunk(text=text, tokens=1,
                 finish_reason=field(details, "finish_reason", str, "details.finish_reason", event),
                 usage_output_tokens=field(details, "generated_tokens", int, "details.generated_tokens", event),
                 usage_input_tokens=field(details, "input_length", int, "details.input_length", event)), last


class _TGICommon:
    """What both TGI adapters share: the API key, /health + /info readiness, /metrics, the engine version."""

    info: dict[str, Any]

    def url(self, path: str) -> str:
        return self.ctx.base_url.rstrip("/") + path  # type: ignore[attr-defined]

    def headers(self) -> dict[str, str]:
        key = os.environ.get(API_KEY_ENV)
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def ready(self, session) -> bool:
        async with session.get(self.url("/health"), headers=self.headers()) as r:
            if r.status != 200:
                return False
        if not getattr(self, "info", None):
            try:
                async with session.get(self.url("/info"), headers=self.headers()) as r:
                    info = json.loads(await r.text()) if r.status == 200 else {}
                self.info = info if isinstance(info, dict) else {}
            except Exception:  # best effort: without /info the trace header has no version, nothing worse
                self.info = {}
        return True

    async def scrape(self, session) -> dict[str, float]:
        async with session.get(self.url("/metrics"), headers=self.headers()) as r:
            if r.status != 200:
                return {}
            return parse_prometheus(await r.text(), METRICS_PREFIXES)

    def engine_version(self) -> str:
        return str((getattr(self, "info", None) or {}).get("version") or "")

    def metrics_source(self) -> str:
        return "tgi"

    def start(self) -> None:
        pass  # attached: nothing to start

    def stop(self) -> None:
        pass  # attached: nothing of ours to stop


class TGIServer(_TGICommon, Server):
    """TGI's native protocol: POST /generate_stream, one SSE event per token, details in the last event."""

    forces_output_length = False

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.info = {}

    def payload(self, request: PlannedRequest) -> tuple[str, dict[str, Any]]:
        return "/generate_stream", {"inputs": request.prompt, "parameters": generate_parameters(request)}

    async def stream(self, session, request: PlannedRequest) -> AsyncIterator[Chunk]:
        path, body = self.payload(request)
        async with session.post(self.url(path), json=body, headers=self.headers()) as response:
            if response.status != 200:  # TGI itself only does this for bodies it cannot parse (422)
                raise http_failure(response.status, await response.text())
            last = False
            async for data in sse_events(response):
                if last:
                    raise RequestFailed("malformed", f"data after TGI's last event: {data[:200]!r}")
                chunk, last = parse_stream_event(json_event(data))
                yield chunk
            if not last:
                raise RequestFailed("truncated", "truncated: the stream ended before TGI's last event (generated_text, "
                                                 "details)")


class TGIOpenAIServer(_TGICommon, OpenAICompatibleServer):
    """TGI's OpenAI-style routes, /v1/completions and /v1/chat/completions (streams end with ``data: [DONE]``).

    TGI emits one chunk per generated token on these routes too, so a chunk with a choice says
    ``tokens=1`` (a special token's chunk has empty text but still counts). Usage comes in the
    last chunk of /v1/completions always, and as a separate ``choices: []`` chunk on chat when
    ``stream_options.include_usage`` is set (it is).
    """

    api_key_env = API_KEY_ENV
    metrics_prefixes = METRICS_PREFIXES
    supports_ignore_eos = False
    done_required = True  # TGI's /v1 streams always end with data: [DONE]

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.info = {}

    def model_name(self) -> str:
        return OPENAI_MODEL

    def payload(self, request: PlannedRequest) -> tuple[str, dict[str, Any]]:
        path, body = super().payload(request)
        if path == "/v1/completions":
            body.pop("stream_options", None)  # not a CompletionRequest field; usage is always in the last chunk
            body["prompt"] = [request.prompt]  # the spec's Prompt is an array of strings (one prompt, choice 0)
        return path, body

    def in_band_error(self, event: dict[str, Any]) -> RequestFailed:
        error = event["error"]
        kind = event.get("error_type") or "error"
        if isinstance(error, dict):  # the OpenAI shape, {"error": {"message": ...}}
            error = error.get("message") or error
        return RequestFailed("in_band", f"TGI {kind} error: {str(error)[:300]}")

    def parse_event(self, event: dict[str, Any]) -> Chunk:
        chunk = super().parse_event(event)
        choices = event.get("choices") or []
        return attrs.evolve(chunk, tokens=1) if len(choices) == 1 else chunk
