"""A minimal OpenAI-compatible streaming server for the load generator's tests (run as a subprocess,
so it does not share the generator's event loop or clock).

    python tests/fake_openai.py PORT [--cycle ok,429,...] [--first-ms 30] [--token-ms 5] [--exit-after N]
        [--require-key KEY] [--echo-auth] [--models ok|html|text|list|noid|starting] [--log FILE]

Modes, applied round-robin in arrival order (``--cycle``). The protocol's own: ok (one SSE chunk per
token, then a usage chunk and [DONE]), 429, 500 (the API's error object), inband (HTTP 200 with an error
event), keepalive (ok with ':' comment lines between chunks). Misbehaviours, each a fault a real server,
proxy or network can show: malformed (a non-JSON data line), hang (headers, then silence), stall (no
headers at all, silence), cut (two chunks, then the connection is closed mid-stream), truncated (two chunks,
then the response ends cleanly, as a proxy or an engine that stops early ends it: a well-formed HTTP and SSE
stream with no finish reason, no usage and no [DONE]), badusage
(usage.completion_tokens as text, "8"), badfinish (finish_reason as a number), badtext (a choice's text,
or a chat delta's content, as a number), notext (every chunk's text empty, the usage counting the tokens: what
an engine that streams text sends for tokens that make no whole UTF-8 character), empty (no chunk, usage 0),
list / null / number (an event that is a JSON list, null or a
number, where the protocol has an object).

--echo-auth: error bodies (HTTP errors, in-band errors, malformed data) and /metrics quote the
Authorization header received, as some servers and proxies do. --models: what GET /v1/models answers:
the model list (ok), or with HTTP 200 a web server's HTML page (html), plain text (text), a JSON list
(list), a list whose entries have no id (noid); or HTTP 503, as a proxy before a server that is still
loading its model does (starting).
"""

import argparse
import asyncio
import json
import os
import time

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--cycle", default="ok")
    p.add_argument("--first-ms", type=float, default=0.0)
    p.add_argument("--token-ms", type=float, default=0.0)
    p.add_argument("--exit-after", type=int, default=0)
    p.add_argument("--require-key", default="")
    p.add_argument("--echo-auth", action="store_true")
    p.add_argument("--models", default="ok", choices=("ok", "html", "text", "list", "noid", "starting"))
    p.add_argument("--log", default="", help="append each request's JSON body, with its arrival time "
                   "(time.monotonic_ns, the system-wide clock), as a line of this file")
    args = p.parse_args()
    modes = args.cycle.split(",")
    state = {"n": 0}

    async def health(request):
        return web.json_response({"status": "ok"})

    def error(message, kind, request):
        """The API's error object; with --echo-auth its message quotes the Authorization header received."""
        if args.echo_auth:
            message += f" (request had Authorization: {request.headers.get('Authorization')})"
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    async def models(request):
        if args.models == "html":
            page = "<!DOCTYPE html>\n<html>\n<head><title>Welcome to nginx!</title></head>\n<body>\n<h1>Welcome</h1>\n"
            return web.Response(text=page + "</body>\n</html>\n", content_type="text/html")
        if args.models == "text":
            return web.Response(text="OK")
        if args.models == "list":
            return web.json_response(["fake-model"])
        if args.models == "starting":
            return web.json_response(error("the model is loading", "server_error", request), status=503)
        if args.models == "noid":
            return web.json_response({"object": "list", "data": [{"name": "fake-model"}]})
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request):
        if args.require_key and request.headers.get("Authorization") != f"Bearer {args.require_key}":
            return web.json_response(error("Incorrect API key provided", "invalid_request_error", request),
                                     status=401)
        body = await request.json()
        if args.log:
            with open(args.log, "a") as f:
                f.write(json.dumps({"t_ns": time.monotonic_ns(), "path": request.path, "body": body}) + "\n")
        mode = modes[state["n"] % len(modes)]
        state["n"] += 1
        state["auth"] = request.headers.get("Authorization", "")
        if args.exit_after and state["n"] > args.exit_after:
            os._exit(0)  # the engine dies
        if mode in ("429", "500"):
            return web.json_response(error("nope", "server_error", request), status=int(mode))
        if mode == "stall":
            await asyncio.sleep(3600)  # before any header
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "inband":
            await resp.write(f"data: {json.dumps(error('overloaded', 'server_error', request))}\n\n".encode())
            return resp
        if mode == "malformed":
            echo = f" {request.headers.get('Authorization')}" if args.echo_auth else ""
            await resp.write(f"data: {{not json{echo}\n\n".encode())
            return resp
        if mode in ("list", "null", "number"):
            event = {"list": [{"index": 0, "text": " t0"}], "null": None, "number": 42}[mode]
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        chat = "messages" in body
        await asyncio.sleep(args.first_ms / 1000)
        n = body["max_tokens"]
        for i in range(n):
            if i:
                await asyncio.sleep(args.token_ms / 1000)
            if mode == "keepalive":
                await resp.write(b": keep-alive\n\n")
            if mode == "cut" and i == 2:
                request.transport.close()  # the connection drops mid-stream: no more chunks, no [DONE]
                return resp
            if mode == "truncated" and i == 2:
                await resp.write_eof()  # the stream ends properly (chunked encoding's last chunk), early
                return resp
            if mode == "empty":
                break
            text = i if mode == "badtext" else "" if mode == "notext" else f" t{i}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            if i == n - 1:
                choice["finish_reason"] = 7 if mode == "badfinish" else "length"
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": len(str(body.get("prompt", "")).split()),
                 "completion_tokens": str(n) if mode == "badusage" else 0 if mode == "empty" else n}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(request):
        text = f"# HELP fake_requests_total requests\nfake_requests_total {state['n']}\n"
        if args.echo_auth and state.get("auth"):
            text += f'fake_last_request{{authorization="{state["auth"]}"}} 1\n'
        return web.Response(text=text)

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.get("/metrics", metrics),
                    web.post("/v1/completions", completions), web.post("/v1/chat/completions", completions)])
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
