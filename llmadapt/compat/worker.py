"""``python -m llmadapt.worker RUN_DIR``: the old name of ``python -m llmadapt.runtime.worker`` (batch scripts
written before 0.2 name it); kept for one release."""

from llmadapt.compat import moved
from llmadapt.runtime.worker import main

moved("python -m llmadapt.worker", "python -m llmadapt.runtime.worker", __name__)

if __name__ == "__main__":
    main()
