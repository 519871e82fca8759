"""``python -m llmadapt.runtime RUN_DIR``: the one worker entry point (llmadapt.runtime.kinds)."""

from llmadapt.runtime.kinds import main

if __name__ == "__main__":
    main()
