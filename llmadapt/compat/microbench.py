"""``python -m llmadapt.microbench RUN_DIR``: the old name of ``python -m llmadapt.runtime`` (a worker of kind micro); kept
for one release."""

from llmadapt.compat import moved
from llmadapt.runtime.kinds import main

moved("python -m llmadapt.microbench", "python -m llmadapt.runtime", __name__)

if __name__ == "__main__":
    main()
