"""``python -m llmadapt.worker RUN_DIR``: the old name of ``python -m llmadapt.runtime`` (batch scripts
written before 0.2 name it); kept for one release."""

from llmadapt.compat import moved
from llmadapt.runtime.kinds import main

moved("python -m llmadapt.worker", "python -m llmadapt.runtime", __name__)

if __name__ == "__main__":
    main()
