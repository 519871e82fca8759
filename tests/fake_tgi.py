"""A TGI 3.3.x protocol server for the tgi adapters' tests (aiohttp, run as a subprocess like fake_openai.py,
so it shares neither the load generator's event loop nor its clock). It generates no text: it plays TGI's
router, with a word-count "tokenizer" and made-up tokens.

    python tests/fake_tgi.py PORT [--cycle ok,eos,...] [--first-ms 0] [--token-ms 0] [--keepalive-ms 0]
        [--max-total-tokens 4096] [--max-concurrent-requests 128] [--require-key KEY] [--unhealthy-polls 0]
        [--replay SNAPSHOT.json] [--version 3.3.6] [--model-id fake-org/tiny-llama]

Modes, applied round-robin to generating requests in arrival order (``--cycle``):
  ok          max_new_tokens tokens, finish_reason length
  eos         half of them, the last one the special EOS token, finish_reason eos_token
  stop        half of them, finish_reason stop_sequence
  keepalive   ok, with ':' keep-alive comment lines between the token events
  overloaded  in-band {"error": "Model is overloaded", "error_type": "overloaded"} (HTTP 200 on streams)
  validation  in-band validation error before any token
  generation  a few tokens, then an in-band generation error
  incomplete  a few tokens, then an in-band incomplete_generation error
  drop        a few tokens, then the stream just ends (NOT TGI behaviour: a cut connection/proxy)

Faithful to (read from TGI's router source, router/src/server.rs, infer/mod.rs, chat.rs, validation.rs, in
the public huggingface/text-generation-inference repository, and to its docs/openapi.json):
- POST /generate_stream: HTTP 200 and SSE, one ``data:`` event per token
  {index (from 1), token{id,text,logprob,special}, generated_text: null, details: null}; the last event
  carries generated_text (special tokens skipped) and, if parameters.details, details {finish_reason,
  generated_tokens, seed, input_length}; no [DONE]. Headers x-compute-type, x-compute-characters,
  X-Accel-Buffering: no (no timing headers on streams).
- Errors on streams are in-band events {"error", "error_type"} with HTTP 200, with TGI's messages and types
  (overloaded, validation, generation, incomplete_generation); on /generate they are HTTP 424/429/422/500
  with the same JSON body. The concurrency permit is taken before validation (overloaded first).
- Validation that the router does itself: empty inputs, max_new_tokens 0, inputs + max_new_tokens >
  max_total_tokens, temperature <= 0, more than 4 stop sequences, best_of != 1 or decoder_input_details on a
  stream. A missing ``parameters`` object takes the router's defaults (details false: no details at all).
- POST /generate: GenerateResponse with details {finish_reason, generated_tokens, seed, prefill, tokens} and
  the x-compute-type, x-compute-time (seconds, float), x-compute-characters, x-total-time,
  x-validation-time, x-queue-time, x-inference-time, x-time-per-token (integer ms), x-prompt-tokens,
  x-generated-tokens headers.
- POST / (compat): stream true -> /generate_stream; false -> [GenerateResponse] (list-wrapped), and
  return_full_text defaults to true (pipeline tag text-generation).
- /v1/completions and /v1/chat/completions (stream and not), ending with data: [DONE]; completions chunks
  carry finish_reason "" until the last, which has TGI's own reason name (eos_token, ...) and the usage;
  chat uses OpenAI names (eos_token and stop_sequence -> "stop"), a special token gives content "", usage
  comes as a separate choices: [] chunk only with stream_options.include_usage. A ``model`` other than "tgi"
  becomes a LoRA adapter_id (TGI PR #2128); this server has no adapters, so such requests fail.
- --require-key guards the generating routes only (Authorization: Bearer KEY, else 401 with no body), as the
  router's base_routes; /health, /info, /metrics, /v1/models stay open.
- GET /health (200, empty body; 503 {"error":"unhealthy","error_type":"healthcheck"} for the first
  --unhealthy-polls calls), GET /info (Info), GET /v1/models ({"object":"list","data":[ModelInfo]}, which
  is what the router returns, not the bare ModelInfo its spec declares), GET /metrics (Prometheus text with
  tgi_request_count, _success, _failure{err}, tgi_queue_size, tgi_batch_current_size, duration and token
  histograms, tgi_batch_forward_duration{method}).
- A body the router cannot deserialize gets axum's 422 text/plain rejection.

Not faithful (and not checked against a live TGI; see plugins/tgi/README.md):
- No model: tokens are " t0", " t1", ... (ids 1000+), EOS is {"id": 2, "text": "</s>", "special": true};
  input_length is the number of whitespace-separated words (a real Llama tokenizer differs and adds BOS).
- No batching, scheduling, speculative decoding (which makes real events arrive in bursts) or KV cache;
  the timings are the --first-ms/--token-ms sleeps and the metrics are bookkeeping of those.
- Keep-alive: axum sends one comment every 15 s; here only the keepalive mode (or --keepalive-ms) sends them.
- Exact error texts beyond the router's formats, the adapter-not-found failure, the OpenAI routes' error
  event shape in 3.3.x (this server uses the native {"error","error_type"} shape there), the default
  max_new_tokens when a request omits it (here max_total_tokens - input_length), /tokenize, /chat_tokenize,
  /invocations, tools and grammars: absent, assumed or invented.
- --replay serves a recorded snapshot (../shared/data/tgi/snapshots): /generate bodies are replayed as the
  token events they were collected from (the router builds details.tokens from the same stream); OpenAI
  stream snapshots are served verbatim, as recorded by the test client (so with its null fields).
"""

import argparse
import asyncio
import json
import time
from contextlib import aclosing

from aiohttp import web

EOS = {"id": 2, "text": "</s>", "logprob": -0.25, "special": True}
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 2048)


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)  # serde_json's compact output


class InferError(Exception):
    """TGI's InferError: message (its Display) and error_type; ``status`` where it becomes an HTTP error."""

    STATUS = {"generation": 424, "overloaded": 429, "validation": 422, "incomplete_generation": 500}

    def __init__(self, error_type: str, message: str, metric: str) -> None:
        super().__init__(message)
        self.error_type, self.message, self.metric = error_type, message, metric

    def body(self) -> dict:
        return {"error": self.message, "error_type": self.error_type}


class Metrics:
    """What metrics_exporter_prometheus renders for TGI's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, str], float] = {}
        self.gauges: dict[str, float] = {"tgi_queue_size": 0, "tgi_batch_current_size": 0,
                                         "tgi_batch_current_max_tokens": 0}
        self.hist: dict[tuple[str, str], list] = {}

    def inc(self, name: str, labels: str = "", by: float = 1) -> None:
        self.counters[(name, labels)] = self.counters.get((name, labels), 0) + by

    def observe(self, name: str, value: float, labels: str = "", buckets=DURATION_BUCKETS) -> None:
        h = self.hist.setdefault((name, labels), [buckets, [0] * len(buckets), 0.0, 0])
        for i, le in enumerate(h[0]):
            if value <= le:
                h[1][i] += 1
        h[2] += value
        h[3] += 1

    def render(self) -> str:
        out = []
        for name in sorted({n for n, _ in self.counters}):
            out.append(f"# TYPE {name} counter")
            out += [f"{name}{lab} {int(v)}" for (n, lab), v in sorted(self.counters.items()) if n == name]
            out.append("")
        for name, v in sorted(self.gauges.items()):
            out += [f"# TYPE {name} gauge", f"{name} {v:g}", ""]
        for name in sorted({n for n, _ in self.hist}):
            out.append(f"# TYPE {name} histogram")
            for (n, lab), (buckets, counts, total, count) in sorted(self.hist.items()):
                if n != name:
                    continue
                inner = lab[1:-1] + "," if lab else ""
                out += [f'{name}_bucket{{{inner}le="{le:g}"}} {c}' for le, c in zip(buckets, counts)]
                out += [f'{name}_bucket{{{inner}le="+Inf"}} {count}', f"{name}_sum{lab} {total:g}",
                        f"{name}_count{lab} {count}"]
            out.append("")
        return "\n".join(out) + "\n"


def load_replay(path: str | None) -> dict:
    """A snapshot as something to serve: {"native": generation} or {"openai_stream": events} or {"body": obj}."""
    if not path:
        return {}
    data = json.loads(open(path).read())
    first = data[0] if isinstance(data, list) and data else data
    if isinstance(first, dict) and isinstance(first.get("details"), dict) and "tokens" in first["details"]:
        d = first["details"]
        return {"native": {"tokens": d["tokens"], "finish_reason": d["finish_reason"], "seed": d.get("seed"),
                           "generated_text": first["generated_text"]}}
    if isinstance(data, list):
        return {"openai_stream": data}
    return {"body": data}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--cycle", default="ok")
    p.add_argument("--first-ms", type=float, default=0.0)
    p.add_argument("--token-ms", type=float, default=0.0)
    p.add_argument("--keepalive-ms", type=float, default=0.0)
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--max-concurrent-requests", type=int, default=128)
    p.add_argument("--require-key", default="")
    p.add_argument("--unhealthy-polls", type=int, default=0)
    p.add_argument("--replay", default="")
    p.add_argument("--version", default="3.3.6")
    p.add_argument("--model-id", default="fake-org/tiny-llama")
    args = p.parse_args()
    modes = args.cycle.split(",")
    replay = load_replay(args.replay)
    metrics = Metrics()
    state = {"n": 0, "in_flight": 0, "health_polls": 0}
    info = {
        "model_id": args.model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": args.max_concurrent_requests, "max_best_of": 2, "max_stop_sequences": 4,
        "max_input_tokens": args.max_total_tokens - 1, "max_total_tokens": args.max_total_tokens,
        "validation_workers": 2, "max_client_batch_size": 4, "router": "text-generation-router",
        "version": args.version, "sha": None, "docker_label": None,
    }
    fingerprint = f"{args.version}-native"

    # -- the router's pieces ------------------------------------------------------------------------
    def authorized(request) -> bool:
        return not args.require_key or (request.headers.get("Authorization", "").lower()
                                        == f"Bearer {args.require_key}".lower())

    async def read_body(request, required: str):
        """axum's Json extractor: a body it cannot deserialize is a 422 text/plain rejection."""
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            raise web.HTTPUnprocessableEntity(text=f"Failed to parse the request body as JSON: {exc}") from None
        if not isinstance(body, dict) or required not in body:
            raise web.HTTPUnprocessableEntity(
                text=f"Failed to deserialize the JSON body into the target type: missing field `{required}`")
        return body

    def validate(inputs: str, params: dict, stream: bool) -> tuple[int, int]:
        """(input_length, max_new_tokens), or InferError("validation") as router/src/validation.rs words it."""
        def bad(msg: str) -> InferError:
            return InferError("validation", f"Input validation error: {msg}", "validation")

        if stream and (params.get("best_of") or 1) != 1:
            raise bad("`best_of` != 1 is not supported when streaming tokens")
        if stream and params.get("decoder_input_details"):
            raise bad("`decoder_input_details` == true is not supported when streaming tokens")
        temperature = params.get("temperature")
        if temperature is not None and temperature <= 0:
            raise bad("`temperature` must be strictly positive")
        if len(params.get("stop") or []) > 4:
            raise bad(f"`stop` supports up to 4 stop sequences. Given: {len(params['stop'])}")
        if not inputs:
            raise bad("`inputs` cannot be empty")
        input_length = len(inputs.split())
        max_new = params.get("max_new_tokens")
        if max_new is None:
            max_new = max(args.max_total_tokens - input_length, 0)
        if max_new == 0:
            raise bad("`max_new_tokens` must be strictly positive")
        if input_length + max_new > args.max_total_tokens:
            raise bad(f"`inputs` tokens + `max_new_tokens` must be <= {args.max_total_tokens}. "
                      f"Given: {input_length} `inputs` tokens and {max_new} `max_new_tokens`")
        metrics.observe("tgi_request_input_length", input_length, buckets=TOKEN_BUCKETS)
        metrics.observe("tgi_request_max_new_tokens", max_new, buckets=TOKEN_BUCKETS)
        return input_length, max_new

    async def infer(inputs: str, params: dict, stream: bool):
        """Infer::generate_stream plus the backend: yields ("token", token) ... ("end", token, generated), or
        raises InferError. The permit is held for the whole generation, as TGI's semaphore permit is."""
        metrics.inc("tgi_request_count")
        if state["in_flight"] >= args.max_concurrent_requests:
            metrics.inc("tgi_request_failure", '{err="overloaded"}')
            raise InferError("overloaded", "Model is overloaded", "overloaded")
        state["in_flight"] += 1
        metrics.gauges["tgi_batch_current_size"] = state["in_flight"]
        try:
            t0 = time.monotonic()
            try:
                input_length, max_new = validate(inputs, params, stream)
            except InferError:
                metrics.inc("tgi_request_failure", '{err="validation"}')
                raise
            mode = modes[state["n"] % len(modes)]
            state["n"] += 1
            if mode in ("overloaded", "validation"):
                err = (InferError("overloaded", "Model is overloaded", "overloaded") if mode == "overloaded" else
                       InferError("validation", f"Input validation error: `inputs` tokens + `max_new_tokens` must "
                                  f"be <= {args.max_total_tokens}. Given: {input_length} `inputs` tokens and "
                                  f"{args.max_total_tokens} `max_new_tokens`", "validation"))
                metrics.inc("tgi_request_failure", f'{{err="{err.metric}"}}')
                raise err
            if replay.get("native"):
                tokens = list(replay["native"]["tokens"])
                finish, seed = replay["native"]["finish_reason"], replay["native"]["seed"]
            else:
                seed = None if not params.get("do_sample") else params.get("seed", 42)
                tokens, finish = plan_tokens(mode, max_new, params.get("stop") or [])
            cut = max(1, len(tokens) // 2) if mode in ("generation", "incomplete", "drop") else None
            await asyncio.sleep(args.first_ms / 1000)
            metrics.observe("tgi_batch_forward_duration", args.first_ms / 1000, '{method="prefill"}')
            started = time.monotonic()
            for i, token in enumerate(tokens):
                if i:
                    await asyncio.sleep(args.token_ms / 1000)
                    metrics.observe("tgi_batch_forward_duration", args.token_ms / 1000, '{method="decode"}')
                if cut is not None and i == cut:
                    if mode == "drop":
                        return  # the stream ends with neither a last event nor an error
                    err = (InferError("generation", "Request failed during generation: Server error: CUDA out of "
                                      "memory", "generation") if mode == "generation"
                           else InferError("incomplete_generation", "Incomplete generation", "incomplete"))
                    metrics.inc("tgi_request_failure", f'{{err="{err.metric}"}}')
                    raise err
                if i < len(tokens) - 1:
                    yield ("token", token, mode == "keepalive")
                    continue
                now = time.monotonic()
                total, inference = now - t0, now - started + args.first_ms / 1000
                n = len(tokens)
                metrics.inc("tgi_request_success")
                metrics.observe("tgi_request_duration", total)
                metrics.observe("tgi_request_validation_duration", 0.0)
                metrics.observe("tgi_request_queue_duration", 0.0)
                metrics.observe("tgi_request_inference_duration", inference)
                metrics.observe("tgi_request_mean_time_per_token_duration", inference / n)
                metrics.observe("tgi_request_generated_tokens", n, buckets=TOKEN_BUCKETS)
                text = (replay["native"]["generated_text"] if replay.get("native")
                        else "".join(t["text"] for t in tokens if not t["special"]))
                if params.get("return_full_text"):
                    text = inputs + text
                yield ("end", token, {"text": text, "finish_reason": finish, "generated_tokens": n, "seed": seed,
                                      "input_length": input_length, "total": total, "inference": inference,
                                      "tokens": tokens})
        finally:
            state["in_flight"] -= 1
            metrics.gauges["tgi_batch_current_size"] = state["in_flight"]

    def plan_tokens(mode: str, max_new: int, stop: list[str]) -> tuple[list[dict], str]:
        count = max_new if mode not in ("eos", "stop") else max(1, max_new // 2)
        tokens, text = [], ""
        for i in range(count):
            if mode == "eos" and i == count - 1:
                tokens.append(dict(EOS))
                return tokens, "eos_token"
            token = {"id": 1000 + i, "text": f" t{i}", "logprob": -0.5, "special": False}
            tokens.append(token)
            text += token["text"]
            if any(s and text.endswith(s) for s in stop):
                return tokens, "stop_sequence"
        return tokens, "stop_sequence" if mode == "stop" else "length"

    def stream_headers(inputs: str) -> dict:
        return {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "x-compute-type": "gpu+optimized",
                "x-compute-characters": str(len(inputs)), "X-Accel-Buffering": "no"}

    async def sse(request, inputs: str, events):
        """Stream ``events`` (an async iterator of payload strings or None = keep-alive) as TGI's SSE."""
        resp = web.StreamResponse(headers=stream_headers(inputs))
        await resp.prepare(request)
        keepalive = None
        if args.keepalive_ms:
            async def beat():
                while True:
                    await asyncio.sleep(args.keepalive_ms / 1000)
                    await resp.write(b":\n\n")
            keepalive = asyncio.create_task(beat())
        try:
            async with aclosing(events) as stream:
                async for payload in stream:
                    await resp.write(b":\n\n" if payload is None else f"data: {payload}\n\n".encode())
        except ConnectionResetError:
            pass  # the client went away; aclosing released the permit
        finally:
            if keepalive:
                keepalive.cancel()
        return resp

    # -- native routes ------------------------------------------------------------------------------
    async def native_events(inputs: str, params: dict):
        details = bool(params.get("details"))
        index = 0
        try:
            async with aclosing(infer(inputs, params, stream=True)) as gen:
                async for item in gen:
                    index += 1
                    if item[0] == "token":
                        if item[2]:
                            yield None  # keep-alive comment
                        yield dumps({"index": index, "token": item[1], "generated_text": None, "details": None})
                    else:
                        g = item[2]
                        yield dumps({"index": index, "token": item[1], "generated_text": g["text"],
                                     "details": {"finish_reason": g["finish_reason"],
                                                 "generated_tokens": g["generated_tokens"], "seed": g["seed"],
                                                 "input_length": g["input_length"]} if details else None})
        except InferError as err:
            yield dumps(err.body())

    async def generate_stream(request, body=None):
        if not authorized(request):
            return web.Response(status=401)
        body = body or await read_body(request, "inputs")
        params = body.get("parameters")
        params = params if isinstance(params, dict) else {"details": False}
        return await sse(request, body["inputs"], native_events(body["inputs"], params))

    async def generate_once(inputs: str, params: dict):
        """generate_internal: (GenerateResponse, headers), or InferError."""
        t0 = time.monotonic()
        g = None
        async for item in infer(inputs, params, stream=False):
            if item[0] == "end":
                g = item[2]
        if g is None:  # Infer::generate without an End message
            metrics.inc("tgi_request_failure", '{err="incomplete"}')
            raise InferError("incomplete_generation", "Incomplete generation", "incomplete")
        details = None
        if params.get("details") or params.get("decoder_input_details"):
            prefill = []
            if params.get("decoder_input_details"):
                prefill = [{"id": 500 + i, "text": w, "logprob": None if i == 0 else -1.0}
                           for i, w in enumerate(inputs.split())]
            details = {"finish_reason": g["finish_reason"], "generated_tokens": g["generated_tokens"],
                       "seed": g["seed"], "prefill": prefill, "tokens": g["tokens"]}
        total = time.monotonic() - t0
        ms = lambda s: str(int(s * 1000))  # noqa: E731  (Duration::as_millis)
        headers = {
            "x-compute-type": "gpu+optimized", "x-compute-time": repr(total), "x-compute-characters": str(len(inputs)),
            "x-total-time": ms(total), "x-validation-time": "0", "x-queue-time": "0",
            "x-inference-time": ms(g["inference"]), "x-time-per-token": ms(g["inference"] / g["generated_tokens"]),
            "x-prompt-tokens": str(g["input_length"]), "x-generated-tokens": str(g["generated_tokens"]),
        }
        response = {"generated_text": g["text"]}
        if details is not None:
            response["details"] = details
        return response, headers

    async def generate(request, body=None, wrap=False):
        if not authorized(request):
            return web.Response(status=401)
        body = body or await read_body(request, "inputs")
        params = body.get("parameters")
        params = params if isinstance(params, dict) else {"details": False}
        try:
            response, headers = await generate_once(body["inputs"], params)
        except InferError as err:
            return web.json_response(err.body(), status=InferError.STATUS[err.error_type])
        return web.Response(text=dumps([response] if wrap else response), headers=headers,
                            content_type="application/json")

    async def compat(request):
        if not authorized(request):
            return web.Response(status=401)
        body = await read_body(request, "inputs")
        params = dict(body.get("parameters") or {"details": False})
        if params.get("return_full_text") is None:
            params["return_full_text"] = True  # compat_return_full_text for pipeline tag text-generation
        body["parameters"] = params
        if body.get("stream"):
            return await generate_stream(request, body)
        return await generate(request, body, wrap=True)

    # -- OpenAI-style routes ------------------------------------------------------------------------
    def openai_finish(reason: str) -> str:
        return "length" if reason == "length" else "stop"  # FinishReason::format(true)

    def openai_chunks(item, chat: bool, include_usage: bool, base: dict) -> list[str]:
        """The /v1 stream events for one token (chat.rs create_event_from_stream_token, completions in server.rs)."""
        token, last = item[1], item[0] == "end"
        g = item[2] if last else None
        usage = {"prompt_tokens": g["input_length"], "completion_tokens": g["generated_tokens"],
                 "total_tokens": g["input_length"] + g["generated_tokens"]} if last else None
        if chat:
            delta = {"role": "assistant", "content": "" if token["special"] else token["text"]}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": openai_finish(g["finish_reason"]) if last else None}
            out = [dumps({"object": "chat.completion.chunk", **base, "choices": [choice], "usage": None})]
            if last and include_usage:
                out.append(dumps({"object": "chat.completion.chunk", **base, "choices": [], "usage": usage}))
            return out
        # completions: finish_reason "" until the last chunk, which has FinishReason's Display and the usage
        choice = {"finish_reason": g["finish_reason"] if last else "", "index": 0, "logprobs": None,
                  "text": token["text"]}
        event = {"object": "text_completion", **base, "choices": [choice]}
        if last:
            event["usage"] = usage
        return [dumps(event)]

    async def openai(request):
        if not authorized(request):
            return web.Response(status=401)
        chat = request.path.endswith("/chat/completions")
        body = await read_body(request, "messages" if chat else "prompt")
        if not chat and body.get("suffix") is not None:
            return web.json_response({"error": "Suffix is not supported and can be achieved by preprocessing the "
                                      "prompt.", "error_type": "suffix not supported"}, status=422)
        if chat:
            inputs = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    return web.json_response({"error": "this fake serves one prompt per request",
                                              "error_type": "fake"}, status=422)
                prompt = prompt[0]
            inputs = str(prompt)
        temperature = body.get("temperature")
        greedy = temperature == 0.0
        params = {"max_new_tokens": body.get("max_tokens") or 100, "details": True,
                  "do_sample": not greedy, "temperature": None if greedy else temperature,
                  "stop": body.get("stop") or [], "seed": body.get("seed")}
        model = body.get("model")
        adapter = model if model not in (None, "tgi") else None
        created = int(time.time())
        base = {"id": "", "created": created, "model": args.model_id, "system_fingerprint": fingerprint}
        stream = bool(body.get("stream"))
        if stream and replay.get("openai_stream"):
            async def verbatim():
                for event in replay["openai_stream"]:
                    await asyncio.sleep(args.token_ms / 1000)
                    yield dumps(event)
                yield "[DONE]"
            return await sse(request, inputs, verbatim())
        if not stream and replay.get("body"):
            return web.Response(text=dumps(replay["body"]), content_type="application/json")

        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            async def events():
                try:
                    if adapter:
                        metrics.inc("tgi_request_count")
                        metrics.inc("tgi_request_failure", '{err="generation"}')
                        raise InferError("generation", f"Request failed during generation: Server error: "
                                         f"adapter {adapter!r} is not loaded", "generation")
                    async with aclosing(infer(inputs, params, stream=True)) as gen:
                        async for item in gen:
                            if item[0] == "token" and item[2]:
                                yield None  # keep-alive comment
                            for payload in openai_chunks(item, chat, include_usage, base):
                                yield payload
                except InferError as err:
                    yield dumps(err.body())
                yield "[DONE]"

            return await sse(request, inputs, events())

        if adapter:
            return web.json_response({"error": f"Request failed during generation: Server error: adapter "
                                      f"{adapter!r} is not loaded", "error_type": "generation"}, status=424)
        try:
            response, headers = await generate_once(inputs, params)
        except InferError as err:
            return web.json_response(err.body(), status=InferError.STATUS[err.error_type])
        d = response["details"]
        usage = {"prompt_tokens": int(headers["x-prompt-tokens"]), "completion_tokens": d["generated_tokens"],
                 "total_tokens": int(headers["x-prompt-tokens"]) + d["generated_tokens"]}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": response["generated_text"]},
                      "logprobs": None, "finish_reason": openai_finish(d["finish_reason"])}
            out = {"object": "chat.completion", **base, "choices": [choice], "usage": usage}
        else:
            choice = {"finish_reason": openai_finish(d["finish_reason"]), "index": 0, "logprobs": None,
                      "text": response["generated_text"]}
            out = {"object": "text_completion", **base, "choices": [choice], "usage": usage}
        return web.Response(text=dumps(out), headers=headers, content_type="application/json")

    # -- info routes (never behind the key) -----------------------------------------------------------
    async def health(request):
        state["health_polls"] += 1
        if state["health_polls"] <= args.unhealthy_polls:
            return web.json_response({"error": "unhealthy", "error_type": "healthcheck"}, status=503)
        return web.Response(status=200)

    async def get_info(request):
        return web.Response(text=dumps(info), content_type="application/json")

    async def models(request):
        return web.Response(text=dumps({"object": "list", "data": [
            {"id": args.model_id, "object": "model", "created": 0, "owned_by": args.model_id}]}),
            content_type="application/json")

    async def prometheus(request):
        return web.Response(text=metrics.render(), content_type="text/plain")

    app = web.Application()
    app.add_routes([
        web.get("/health", health), web.get("/ping", health), web.get("/", health), web.get("/info", get_info),
        web.get("/metrics", prometheus), web.get("/v1/models", models),
        web.post("/generate", generate), web.post("/generate_stream", generate_stream), web.post("/", compat),
        web.post("/v1/completions", openai), web.post("/v1/chat/completions", openai),
    ])
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
