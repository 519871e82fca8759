"""``python -m llmadapt.microbench RUN_DIR``: the old name of ``python -m llmadapt.runtime.microbench``; kept
for one release."""

from llmadapt.runtime import lifecycle
from llmadapt.runtime.microbench import main

if __name__ == "__main__":
    lifecycle.exit_process(main())
