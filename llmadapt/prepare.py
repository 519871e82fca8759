"""``python -m llmadapt.prepare MODEL_JSON SEED``: build (or find) the canonical checkpoint in this
environment and print its path. The orchestrator uses it before starting a serving engine."""

import json
import sys

from .models import canonical_checkpoint
from .spec import ModelSpec


def main() -> None:
    model = ModelSpec(**json.loads(sys.argv[1]))
    print(canonical_checkpoint(model, int(sys.argv[2])))


if __name__ == "__main__":
    main()
