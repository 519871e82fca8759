"""Writes tiny request-stream files for serve.source (docs/serving.md, "Request streams"), in the layouts real
ones have, small enough for the tiny presets' 256 positions:

- sharegpt-tiny.json: 12 conversations in the ShareGPT layout (a JSON list of {"conversations": [{"from": "human",
  "value": ...}, {"from": "gpt", "value": ...}, ...]}), one to three turns each; one starts with a gpt turn and
  one has a human turn alone, as real files do (neither gives a prompt);
- prompts-tiny.jsonl: 10 prompts, one object per line ({"prompt": ..., "answer": ...}), the last three without
  an answer;
- mooncake-tiny.jsonl: 10 requests of a Mooncake-layout trace (timestamp in ms, input_length, output_length,
  hash_ids), requests sharing hash ids as a trace's shared prefixes do (with block_size = 8).

    python examples/data/stream_samples.py [FOLDER]   # default: next to this script; byte for byte the same
"""

import json
import random
import sys
from pathlib import Path

WORDS = ("apple river stone tree house cloud bird lamp water light green small quick brown dog cat runs over "
         "the lazy fox road city night day time world music book paper story").split()


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."


def sharegpt(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(12):
        turns = []
        for _ in range(1 + i % 3):
            turns.append({"from": "human", "value": sentence(rng, 3, 12)})
            turns.append({"from": "gpt", "value": sentence(rng, 2, 16)})
        out.append({"id": f"conv-{i}", "conversations": turns})
    out[4]["conversations"] = out[4]["conversations"][1:]  # starts with the answer: no prompt
    out[7]["conversations"] = out[7]["conversations"][:1]  # a question never answered: no prompt
    return out


def prompts(seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    rows = [{"prompt": sentence(rng, 4, 14), "answer": sentence(rng, 2, 10)} for _ in range(10)]
    for row in rows[7:]:
        del row["answer"]
    return rows


def mooncake(seed: int = 2) -> list[dict]:
    rng = random.Random(seed)
    rows, t, next_id = [], 0, 0
    for i in range(10):
        t += rng.randint(20, 120)
        n_in = rng.randint(10, 30)
        blocks = -(-n_in // 8)
        shared = [0, 1][: min(blocks - 1, 2)] if i % 2 else []  # every other request shares the first blocks
        ids = shared + list(range(next_id + 2, next_id + 2 + blocks - len(shared)))
        next_id += blocks
        rows.append({"timestamp": t, "input_length": n_in, "output_length": rng.randint(2, 12), "hash_ids": ids})
    return rows


def write(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / "sharegpt-tiny.json", folder / "prompts-tiny.jsonl", folder / "mooncake-tiny.jsonl"]
    files[0].write_text(json.dumps(sharegpt(), indent=1) + "\n")
    files[1].write_text("".join(json.dumps(r) + "\n" for r in prompts()))
    files[2].write_text("".join(json.dumps(r) + "\n" for r in mooncake()))
    return files


if __name__ == "__main__":
    for path in write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent):
        print(path)
