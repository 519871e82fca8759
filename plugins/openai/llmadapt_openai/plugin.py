"""Registers the ``openai`` adapter: attach only, nothing to install or start."""

from __future__ import annotations

from llmadapt.adapter import AdapterInfo, hookimpl

from . import __version__


def _check(workload):
    if workload.kind == "serve" and not workload.serve.url:
        return [("serve.url", None, "the openai adapter attaches to a running server: give its base URL")]
    return []


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="openai",
        version=__version__,
        framework="openai-api",
        roles={"serve": "llmadapt_openai.server:OpenAIServer"},
        environment=None,
        check=_check,
        description="Any OpenAI-compatible URL (completions and chat); API key from OPENAI_API_KEY.",
    ))
