"""Writes tiny files in the layouts of study B's data sets (data.format, eval.format; docs/workloads.md), so the
readers can be tried and tested without downloading anything:

- commonsense-tiny.jsonl: instruction/input/output/answer as in commonsense_15k (multiple choice named in the
  instruction, 'Answer format: answer1/answer2'; the output says 'the correct answer is answer2').
- math-tiny.jsonl: instruction/input/output/answer as in math_14k (the output reasons and ends with the number,
  the answer is the bare number; some rows carry an input).
- hellaswag-tiny.jsonl: ctx/endings/label as HellaSwag publishes it (label a number, or its text as in the
  Hugging Face copy; some rows give ctx_a and ctx_b instead of ctx).
- gsm8k-tiny.jsonl: question/answer as GSM8K publishes it (reasoning, then '#### <number>').

The contents are made up: small sums and everyday facts a tiny model can fit in seconds, nothing from the real
sets. Use your own copies of the real files with the same formats.

    python examples/data/study_b_samples.py   # rewrites the four files next to this script, byte for byte
"""

import json
import random
from pathlib import Path

FACTS = [  # (question, right answer, wrong answer)
    ("Which is heavier", "a stone", "a feather"), ("Which is colder", "snow", "fire"),
    ("Which flies", "a bird", "a house"), ("Which grows", "a tree", "a lamp"),
    ("Which flows", "a river", "a stone"), ("Which gives light", "a lamp", "a cloud"),
    ("Which is taller", "a tree", "an apple"), ("Which can rain", "a cloud", "a bird"),
]
THINGS = ["apples", "stones", "birds", "lamps", "trees", "houses"]
NAMES = ["Tom", "Ana", "Lee", "Mia"]
SCENES = [  # (context, right ending, wrong endings)
    ("A man picks up an apple from the table.", "He takes a bite of it.",
     ["He flies over the house.", "The river sings to him.", "He paints the cloud green."]),
    ("The bird sits on the branch of a tree.", "It opens its wings and flies away.",
     ["It reads a book about stones.", "It turns into a lamp.", "It cooks dinner for the house."]),
    ("A woman turns on the lamp in the room.", "The room fills with light.",
     ["The lamp runs out of the door.", "The room becomes a river.", "She eats the lamp."]),
    ("The children throw stones into the river.", "The stones sink to the bottom.",
     ["The river throws them back.", "The stones fly to the cloud.", "The children become trees."]),
]


def commonsense(seed: int = 0, count: int = 48) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        question, right, wrong = FACTS[i % len(FACTS)]
        options = [right, wrong]
        rng.shuffle(options)
        answer = f"answer{options.index(right) + 1}"
        instruction = (f"Please choose the correct answer to the question: {question}, {options[0]} or "
                       f"{options[1]}?\n\nAnswer1: {options[0]} Answer2: {options[1]}\n\n"
                       "Answer format: answer1/answer2")
        out.append({"instruction": instruction, "input": "", "output": f"the correct answer is {answer}",
                    "answer": answer})
    return out


def math(seed: int = 1, count: int = 48) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        story = f"{name} has {a} {thing} and finds {b} more."
        if i % 4 == 3:  # math_14k has some rows whose numbers come in the input
            instruction, text = f"How many {thing} does {name} have in all?", story
        else:
            instruction, text = f"{story} How many {thing} does {name} have?", ""
        out.append({"instruction": instruction, "input": text,
                    "output": f"{name} has {a} + {b} = {a + b} {thing}. The answer is {a + b}", "answer": str(a + b)})
    return out


def hellaswag(seed: int = 2, count: int = 16) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        ctx, right, wrong = SCENES[i % len(SCENES)]
        endings = [right, *wrong]
        rng.shuffle(endings)
        label = endings.index(right)
        row = {"ind": i, "activity_label": "Everyday life", "ctx": ctx, "endings": endings,
               "label": str(label) if i % 2 else label}  # the Hugging Face copy has the label as text
        if i % 4 == 3:  # HellaSwag also gives the context in two parts
            first, _, second = ctx.partition(" ")
            row = {**{k: v for k, v in row.items() if k != "ctx"}, "ctx_a": first, "ctx_b": second}
        out.append(row)
    return out


def gsm8k(seed: int = 3, count: int = 16) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(2, 9), rng.randint(1, 9)
        c = rng.randint(1, a + b - 1)
        question = f"{name} has {a} {thing}, finds {b} more and gives {c} away. How many {thing} are left?"
        answer = (f"After finding more {name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n"
                  f"After giving some away {a + b} - {c} = <<{a + b}-{c}={a + b - c}>>{a + b - c} are left.\n"
                  f"#### {a + b - c}")
        out.append({"question": question, "answer": answer})
    return out


FILES = {"commonsense-tiny.jsonl": commonsense, "math-tiny.jsonl": math, "hellaswag-tiny.jsonl": hellaswag,
         "gsm8k-tiny.jsonl": gsm8k}


def main() -> None:
    for name, rows in FILES.items():
        path = Path(__file__).with_name(name)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
