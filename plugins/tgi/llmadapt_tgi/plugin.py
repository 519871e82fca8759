"""Registers the ``tgi`` and ``tgi-openai`` adapters: attach only, nothing to install or start."""

from __future__ import annotations

from llmadapt.adapter import AdapterInfo, hookimpl

from . import __version__


def _checker(name: str, native: bool):
    def check(workload):
        if workload.kind != "serve":
            return []
        problems = []
        if not workload.serve.url:
            problems.append(("serve.url", None, f"the {name} adapter attaches to a running TGI server: give its "
                                                "base URL (TGI cannot be started from here)"))
        if native and workload.serve.api == "chat":
            problems.append(("serve.api", "chat", "supported: completions (TGI's native /generate_stream takes a "
                                                  "prompt)"))
        return problems

    return check


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="tgi",
        version=__version__,
        framework="tgi",
        roles={"serve": "llmadapt_tgi.server:TGIServer"},
        environment=None,
        check=_checker("tgi", native=True),
        description="A running TGI 3.3.x server, native protocol (/generate_stream, one SSE event per token); "
                    "output length cannot be forced; API key from TGI_API_KEY.",
    ))
    register(AdapterInfo(
        name="tgi-openai",
        version=__version__,
        framework="tgi",
        roles={"serve": "llmadapt_tgi.server:TGIOpenAIServer"},
        environment=None,
        check=_checker("tgi-openai", native=False),
        description="A running TGI 3.3.x server through its OpenAI-style /v1/completions and /v1/chat/completions; "
                    "output length cannot be forced; API key from TGI_API_KEY.",
    ))
