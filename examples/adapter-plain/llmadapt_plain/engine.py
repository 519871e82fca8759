"""The `plain` adapter's engine: a model folder served over the OpenAI completions API by transformers' model and a
hand-written greedy decoding loop, with nothing but the standard library for HTTP.

    python engine.py MODEL_FOLDER PORT

One request is decoded at a time (the others wait their turn): a worked example of an engine an adapter starts,
not a fast one. Streams one event per token, then the finish reason with the usage, then ``data: [DONE]``.
A prompt that, with the tokens asked, does not fit the model's context is refused with HTTP 400.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


class Engine:
    def __init__(self, folder: str) -> None:
        torch.set_num_threads(1)
        self.folder = folder  # the model's name, as the adapter calls it
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.context = self.model.config.max_position_embeddings
        self.lock = threading.Lock()

    @torch.no_grad()
    def tokens(self, ids: list[int], max_tokens: int, ignore_eos: bool):
        """Greedy decoding with the KV cache: yields each new token id."""
        eos = self.model.config.eos_token_id
        past, step_ids = None, torch.tensor([ids])
        for _ in range(max_tokens):
            out = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            if ignore_eos and eos is not None:
                logits[eos] = -float("inf")
            token = int(logits.argmax())
            yield token
            if token == eos:
                return
            step_ids = torch.tensor([[token]])


class Handler(BaseHTTPRequestHandler):
    engine: Engine

    def log_message(self, *args) -> None:  # quiet: the engine's log is for errors
        pass

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.reply(200, {})
        elif self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": self.engine.folder, "object": "model"}]})
        else:
            self.reply(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self.reply(404, {"error": {"message": f"no route {self.path}"}})
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        engine = self.engine
        ids = engine.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
        max_tokens = int(body.get("max_tokens") or 16)
        if len(ids) + max_tokens > engine.context:
            self.reply(400, {"error": {"message": f"the prompt's {len(ids)} tokens and the {max_tokens} asked "
                                                  f"exceed the model's context of {engine.context}",
                                       "type": "invalid_request_error"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes

        def event(choice: dict, **extra) -> None:
            self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, **choice}], **extra})}\n\n".encode())

        out: list[int] = []
        sent = ""
        finish = "length"
        with engine.lock:
            for token in engine.tokens(ids, max_tokens, bool(body.get("ignore_eos"))):
                out.append(token)
                if token == engine.model.config.eos_token_id:
                    finish = "stop"
                    break
                text = engine.tokenizer.decode(out, skip_special_tokens=True)
                if len(text) > len(sent) and not text.endswith("\ufffd"):  # a whole character more
                    event({"text": text[len(sent):], "finish_reason": None})
                    sent = text
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
        event({"text": "", "finish_reason": finish}, usage=usage)
        self.wfile.write(b"data: [DONE]\n\n")


def main() -> None:
    folder, port = sys.argv[1], int(sys.argv[2])
    Handler.engine = Engine(folder)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
