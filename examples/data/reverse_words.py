"""Writes reverse-words.jsonl: a small task a tiny model learns on a CPU in seconds, to check that fine-tuning
worked (workload.eval). Each prompt names three different words; the answer is them in reverse order; four
choices (the answer and three other orders of the same words) make it a multiple-choice item as well.

Chance: 1/336 for an exact answer from the words alone, 1/4 for the choice. The eight words are single tokens
of the canonical tokenizer, so a two-layer model learns the task, not the spelling.

    python examples/data/reverse_words.py   # rewrites the file next to this script, byte for byte the same
"""

import itertools
import json
import random
from pathlib import Path

WORDS = ["apple", "river", "stone", "tree", "house", "cloud", "bird", "lamp"]


def rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    triples = list(itertools.permutations(WORDS, 3))
    rng.shuffle(triples)
    out = []
    for triple in triples:
        answer = " ".join(reversed(triple))
        others = [" ".join(p) for p in itertools.permutations(triple) if " ".join(p) != answer]
        choices = [answer, *rng.sample(others, 3)]
        rng.shuffle(choices)
        out.append({"instruction": "reverse: " + " ".join(triple), "answer": answer, "choices": choices})
    return out


def main() -> None:
    path = Path(__file__).with_name("reverse-words.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
