"""The conformance suite, run against the worked-example adapter in examples/adapter-plain."""

import pytest

from llmadapt.adapter.plugins import adapters
from llmadapt.testing import AdapterConformance

if "plain" not in adapters():
    pytest.skip("the `plain` adapter is not registered: pip install -e examples/adapter-plain",
                allow_module_level=True)


class TestPlainAdapter(AdapterConformance):
    adapter = "plain"
