"""``python -m llmadapt.microbench RUN_DIR``: the old name of ``python -m llmadapt.runtime.microbench``; kept
for one release."""

from llmadapt.compat import moved
from llmadapt.runtime import lifecycle
from llmadapt.runtime.microbench import main

moved("python -m llmadapt.microbench", "python -m llmadapt.runtime.microbench", __name__)

if __name__ == "__main__":
    lifecycle.exit_process(main())
