"""The ``openai`` Server: the OpenAI streaming protocol against a URL someone else runs."""

from __future__ import annotations

from llmadapt.adapter.sse import OpenAICompatibleServer


class OpenAIServer(OpenAICompatibleServer):
    """Attach-only. The model is the workload's model.path when it has one (what a server started on that folder
    answers to), else the first one /v1/models lists; ignore_eos is sent (servers that know it, like vLLM, force the
    length; others ignore or reject it, and the record says the length was not forced)."""

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
        if self.ctx.workload.model.path:  # named: no need to ask (some servers cannot list what they serve)
            self._model = self.ctx.workload.model.path
            return await super().ready(session)
        models = await self.list_models(session)  # an answer that is not a model list fails the run at once
        if models is None:
            return False
        if models:
            self._model = models[0]["id"]
        return True
