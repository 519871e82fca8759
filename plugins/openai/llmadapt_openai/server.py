"""The ``openai`` Server: the OpenAI streaming protocol against a URL someone else runs."""

from __future__ import annotations

from llmadapt.sse import OpenAICompatibleServer


class OpenAIServer(OpenAICompatibleServer):
    """Attach-only. The model is the first one /v1/models lists; ignore_eos is sent (servers that know it,
    like vLLM, force the length; others ignore or reject it, and the record says the length was not forced)."""

    supports_ignore_eos = False
    metrics_prefixes = ("",)  # whatever /metrics the server exposes, if any
    _model = "default"

    def start(self) -> None:
        pass  # attached: nothing to start

    def stop(self) -> None:
        pass  # attached: nothing of ours to stop

    def model_name(self) -> str:
        return self._model

    async def ready(self, session) -> bool:
        async with session.get(self.ctx.base_url + "/v1/models", headers=self.headers()) as r:
            if r.status != 200:
                return False
            models = (await r.json()).get("data") or []
            if models:
                self._model = models[0]["id"]
            return True
