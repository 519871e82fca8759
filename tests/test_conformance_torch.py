"""The reference adapter passes the conformance suite it defines for everyone else."""

from llmadapt.testing import AdapterConformance


class TestTorchAdapter(AdapterConformance):
    adapter = "torch"
