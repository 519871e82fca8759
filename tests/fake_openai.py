"""A minimal OpenAI-compatible streaming server for the load generator's tests (run as a subprocess,
so it does not share the generator's event loop or clock).

    python tests/fake_openai.py PORT [--cycle ok,429,...] [--first-ms 30] [--token-ms 5] [--exit-after N]
        [--require-key KEY]

Modes, applied round-robin in arrival order: ok (one SSE chunk per token, then a usage chunk and
[DONE]), 429, 500, inband (HTTP 200 with an error event), malformed (a non-JSON data line),
hang (headers, then silence), keepalive (ok with ':' comment lines between chunks).
"""

import argparse
import asyncio
import json
import os

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--cycle", default="ok")
    p.add_argument("--first-ms", type=float, default=0.0)
    p.add_argument("--token-ms", type=float, default=0.0)
    p.add_argument("--exit-after", type=int, default=0)
    p.add_argument("--require-key", default="")
    args = p.parse_args()
    modes = args.cycle.split(",")
    state = {"n": 0}

    async def health(request):
        return web.json_response({"status": "ok"})

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request):
        if args.require_key and request.headers.get("Authorization") != f"Bearer {args.require_key}":
            return web.json_response({"error": "bad key"}, status=401)
        body = await request.json()
        mode = modes[state["n"] % len(modes)]
        state["n"] += 1
        if args.exit_after and state["n"] > args.exit_after:
            os._exit(0)  # the engine dies
        if mode in ("429", "500"):
            return web.json_response({"error": {"message": "nope"}}, status=int(mode))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "inband":
            await resp.write(b'data: {"error": {"message": "overloaded"}}\n\n')
            return resp
        if mode == "malformed":
            await resp.write(b"data: {not json\n\n")
            return resp
        chat = "messages" in body
        await asyncio.sleep(args.first_ms / 1000)
        n = body["max_tokens"]
        for i in range(n):
            if i:
                await asyncio.sleep(args.token_ms / 1000)
            if mode == "keepalive":
                await resp.write(b": keep-alive\n\n")
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            if i == n - 1:
                choice["finish_reason"] = "length"
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": len(str(body.get("prompt", "")).split()), "completion_tokens": n}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(request):
        return web.Response(text=f"# HELP fake_requests_total requests\nfake_requests_total {state['n']}\n")

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.get("/metrics", metrics),
                    web.post("/v1/completions", completions), web.post("/v1/chat/completions", completions)])
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
