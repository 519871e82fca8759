"""``python -m llmadapt.worker RUN_DIR``: the process the launcher starts in an adapter's environment."""

from llmadapt.runtime import main

if __name__ == "__main__":
    main()
