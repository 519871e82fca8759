"""``python -m llmadapt.worker RUN_DIR``: the old name of ``python -m llmadapt.runtime.worker`` (batch scripts
written before 0.2 name it); kept for one release."""

from llmadapt.runtime.worker import main

if __name__ == "__main__":
    main()
