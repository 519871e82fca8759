"""Request-stream files a user brings for serving (``serve.source.path``), read and checked before anything starts.

Three layouts: ShareGPT conversations (a JSON list of ``{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}``), a JSONL of prompts (one object per line, a prompt text and optionally an
answer text) and a Mooncake trace (JSONL of ``timestamp`` in ms, ``input_length``, ``output_length`` and
optionally ``hash_ids``, one id per block of prompt tokens shared between requests). Each reader returns plain
rows; a file without the fields its layout needs, or a trace whose timestamps go back, raises ValueError with one
line naming the entry. Reading is cached by path, size and modification time: a workload is rebuilt often
(overrides, one per adapter) and a conversation file can be hundreds of megabytes.

Nothing here tokenizes: lengths in tokens are the planner's (llmadapt.runtime.streams).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from llmadapt.host import state_dir

HUMAN = ("human", "user")
ASSISTANT = ("gpt", "assistant", "chatgpt", "bard", "model")


def _stamp(path: str) -> tuple[str, int, int]:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or exc}") from None
    if not os.path.isfile(path):
        raise ValueError("is not a file")
    return path, st.st_size, st.st_mtime_ns


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or exc}") from None


def _jsonl(path: str):
    for number, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number} is not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"line {number} is not a JSON object")
        yield number, row


# -- ShareGPT -----------------------------------------------------------------------------------
COPIES = "sharegpt"
"""The state folder's sub-folder of completed ShareGPT files (``complete_sharegpt``), named by the source's
sha256."""
_LAYOUT = "the ShareGPT layout is one JSON list of conversations"


def read_sharegpt(path: str) -> list[list[tuple[str, str]]]:
    """Every conversation as its (human text, assistant text) pairs, in file order; a conversation whose turns do
    not start with a human turn followed by an assistant one gives the pairs before that point (possibly none).
    A file cut short is read from its completed copy (``complete_sharegpt``)."""
    return _read_sharegpt(*_stamp(path))[0]


def complete_sharegpt(path: str) -> tuple[str, dict[str, Any]]:
    """The ShareGPT file to read for ``path``, and what was done to it. A complete file is itself. A JSON list cut
    short (complete entries, then a partial one, as a download or a package may ship it) is completed once: its
    complete entries are written, atomically, as a valid ShareGPT file under the state folder, named by the
    source's sha256 (``<state>/sharegpt/<sha12>.json``), so that every reader (llmadapt's planner, a worker, another
    tool such as ``vllm bench serve --dataset-path``) reads the same file. ``facts``: the source's file name,
    sha256 and bytes, the conversations kept, the bytes dropped and ``path_used``. Any other layout problem
    raises ValueError (one line)."""
    _, used, facts = _read_sharegpt(*_stamp(path))
    return used, dict(facts)


@functools.lru_cache(maxsize=4)
def _read_sharegpt(path: str, size: int, mtime: int):
    from llmadapt.modelfolder import file_sha256

    text = _sharegpt_text(path)
    if not text.strip():
        raise ValueError(f"is empty: {_LAYOUT}")
    used, dropped = path, 0
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        end, entries = _complete_prefix(text, exc)
        _pairs(entries)  # a layout problem in the kept entries is refused before anything is written
        sha = file_sha256(Path(path))
        used = str(state_dir() / COPIES / f"{sha[:12]}.json")
        _write_once(Path(used), text[:end] + "\n]\n")
        dropped = size - len(text[:end].encode("utf-8"))
        data = json.loads(Path(used).read_text(encoding="utf-8"))  # what every other reader reads
    pairs = _pairs(data)
    facts = {"format": "sharegpt", "file": os.path.basename(path), "sha256": file_sha256(Path(path)),
             "bytes": size, "conversations": len(data), "bytes_dropped": dropped, "path_used": used}
    return pairs, used, facts


def _sharegpt_text(path: str) -> str:
    """The file's text; a file cut inside a multi-byte character loses that character's bytes."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data" and exc.start >= len(data) - 3:
            return data[:exc.start].decode("utf-8")
        raise ValueError(f"is not UTF-8 text (byte {exc.start})") from None


_SPACE = re.compile(r"\s*")


def _complete_prefix(text: str, error: json.JSONDecodeError) -> tuple[int, list[Any]]:
    """Where the last complete entry of a JSON list cut short ends, and the complete entries; ValueError naming the damage for text that is
    not such a list (cut before its first entry ends, or damaged anywhere but at its end)."""
    damaged = ValueError(f"is not JSON ({error.msg} at line {error.lineno}): {_LAYOUT}")
    decoder = json.JSONDecoder()
    i = _SPACE.match(text).end()
    if not text.startswith("[", i):
        raise damaged
    i, end, entries = i + 1, None, []
    while True:
        i = _SPACE.match(text, i).end()
        if entries:
            if i == len(text):
                break  # cut just after an entry
            if not text.startswith(",", i):
                raise damaged
            i = _SPACE.match(text, i + 1).end()
        try:
            entry, j = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            if not _cut_there(text, exc):
                raise ValueError(f"is not JSON ({exc.msg} at line {exc.lineno}): {_LAYOUT}") from None
            break
        i, end = j, j
        entries.append(entry)
    if end is None:
        raise ValueError(f"is cut short before its first complete conversation ({len(text)} characters): {_LAYOUT}")
    return end, entries


def _cut_there(text: str, exc: json.JSONDecodeError) -> bool:
    """A decoding error that only the end of the text explains: a string, or a last token (a word, a number, an
    escape) cut short; a closing bracket or brace in what is left means damage (a trailing comma, say)."""
    rest = text[exc.pos:].rstrip()
    return exc.msg.startswith("Unterminated string") or (len(rest) < 7 and not any(c in rest for c in "]},"))


def _write_once(target: Path, text: str) -> None:
    """``text`` as ``target``, atomically (a temporary file renamed): a reader sees the whole file or none. A
    writer killed before the rename leaves a hidden temporary file, which the next writer removes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the others find the file written
        if target.is_file():
            return
        for stale in target.parent.glob(f".{target.name}.*"):
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            os.fchmod(fd, 0o644)  # readable as any data file (mkstemp makes it the owner's only)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _pairs(data: Any) -> list[list[tuple[str, str]]]:
    if not isinstance(data, list):
        raise ValueError("must be a JSON list of conversations, each {\"conversations\": [{\"from\": \"human\", "
                         "\"value\": ...}, {\"from\": \"gpt\", \"value\": ...}]}")
    out = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"entry {i} has no \"conversations\" list (the ShareGPT layout)")
        for j, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(
                    turn.get("value"), str):
                raise ValueError(f"entry {i}, turn {j} needs a text \"from\" and a text \"value\"")
        pairs = []
        for a, b in zip(turns[::2], turns[1::2]):
            if a["from"].lower() not in HUMAN or b["from"].lower() not in ASSISTANT:
                break
            pairs.append((a["value"], b["value"]))
        out.append(pairs)
    if not any(out):
        raise ValueError("has no conversation that starts with a human turn answered by a gpt turn")
    return out


# -- a JSONL of prompts -------------------------------------------------------------------------
def read_prompts(path: str, prompt_field: str, answer_field: str) -> list[tuple[str, str | None]]:
    """(prompt, answer or None) per line; the answer field is optional on any line."""
    return _read_prompts(*_stamp(path), prompt_field, answer_field)


@functools.lru_cache(maxsize=4)
def _read_prompts(path: str, size: int, mtime: int, prompt_field: str,
                  answer_field: str) -> list[tuple[str, str | None]]:
    out = []
    for number, row in _jsonl(path):
        if not isinstance(row.get(prompt_field), str):
            raise ValueError(f"line {number} needs a text field {prompt_field!r} (serve.source.prompt_field names "
                             "the file's)")
        answer = row.get(answer_field)
        if answer is not None and not isinstance(answer, str):
            raise ValueError(f"line {number}: {answer_field!r} must be text (the answer, whose length in tokens is "
                             "the output length)")
        out.append((row[prompt_field], answer))
    if not out:
        raise ValueError("has no prompts (the file is empty)")
    return out


# -- a Mooncake trace ---------------------------------------------------------------------------
def read_mooncake(path: str) -> list[dict[str, Any]]:
    """Rows of timestamp (ms), input_length, output_length and hash_ids (a list, empty when absent), in file
    order; timestamps must not go back."""
    return _read_mooncake(*_stamp(path))


@functools.lru_cache(maxsize=4)
def _read_mooncake(path: str, size: int, mtime: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    last = None
    for number, row in _jsonl(path):
        ts = row.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
            raise ValueError(f"line {number} needs \"timestamp\", the send time in milliseconds (a number >= 0)")
        for name in ("input_length", "output_length"):
            value = row.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"line {number} needs {name!r}, a whole number of tokens >= 1")
        ids = row.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise ValueError(f"line {number}: \"hash_ids\" must be a list of whole numbers")
        if last is not None and ts < last:
            raise ValueError(f"line {number}: timestamp {ts:g} ms is before the previous line's {last:g} ms "
                             "(a trace is in send order)")
        last = ts
        out.append({"timestamp": ts, "input_length": row["input_length"], "output_length": row["output_length"],
                    "hash_ids": ids})
    if not out:
        raise ValueError("has no requests (the file is empty)")
    return out


# -- the workload's checks ----------------------------------------------------------------------
SOURCE_FIELDS = {
    "synthetic": (),
    "sharegpt": ("path", "min_input_len", "max_input_len", "min_output_len", "max_output_len"),
    "prompts": ("path", "prompt_field", "answer_field", "min_input_len", "max_input_len", "min_output_len",
                "max_output_len"),
    "random": ("range_ratio",),
    "shared_prefix": ("prefixes", "suffixes", "prefix_len", "suffix_len"),
    "multi_turn": ("path", "turns", "think_s", "min_input_len", "max_input_len", "min_output_len", "max_output_len"),
    "mooncake": ("path", "time_scale", "block_size"),
}
"""The fields each kind of serve.source reads (besides kind); another one set away from its default is refused."""

NEEDS_PATH = ("sharegpt", "prompts", "mooncake")


def check_source(w) -> None:
    """serve.source of a serve workload, files included: one WorkloadError naming the field, before anything
    starts."""
    from llmadapt.errors import WorkloadError, not_a_file

    s, src = w.serve, w.serve.source
    default = type(src)()
    for name in ("path", "prompt_field", "answer_field", "min_input_len", "max_input_len", "min_output_len",
                 "max_output_len", "range_ratio", "prefixes", "suffixes", "prefix_len", "suffix_len", "turns",
                 "think_s", "time_scale", "block_size"):
        if getattr(src, name) != getattr(default, name) and name not in SOURCE_FIELDS[src.kind]:
            users = [k for k, fields in SOURCE_FIELDS.items() if name in fields]
            raise WorkloadError(f"serve.source.{name}", getattr(src, name),
                                f"is not read by kind {src.kind!r} (only by {', '.join(users)})")
    if s.arrival.process == "trace":
        raise WorkloadError("serve.arrival.process", "trace", f"serve.source.kind {src.kind!r} makes the requests: "
                            "replay a trace with serve.source.kind = 'mooncake'")
    positions = w.model.max_position_embeddings
    needed = s.warmup_requests + s.requests
    for low, high in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        if getattr(src, high) is not None and getattr(src, low) > getattr(src, high):
            raise WorkloadError(f"serve.source.{low}", getattr(src, low), f"must be <= serve.source.{high}="
                                f"{getattr(src, high)}")
    if src.kind in NEEDS_PATH and not src.path:
        raise WorkloadError("serve.source.path", src.path, f"kind {src.kind!r} reads a file: give its path")
    if src.path:
        if not os.path.isfile(src.path):
            raise WorkloadError("serve.source.path", src.path, not_a_file(src.path))
        try:
            if src.kind in ("sharegpt", "multi_turn"):
                read_sharegpt(src.path)
            elif src.kind == "prompts":
                read_prompts(src.path, src.prompt_field, src.answer_field)
            else:
                rows = read_mooncake(src.path)
        except ValueError as exc:
            raise WorkloadError("serve.source.path", src.path, str(exc)) from None
    output_high = s.output_len.high if s.output_len.dist != "fixed" else s.output_len.mean
    input_high = s.input_len.high if s.input_len.dist != "fixed" else s.input_len.mean
    if src.kind == "random":
        if not src.range_ratio < 1:
            raise WorkloadError("serve.source.range_ratio", src.range_ratio, "must be below 1 (lengths stay >= 1)")
        longest = int(s.input_len.mean * (1 + src.range_ratio)) + int(s.output_len.mean * (1 + src.range_ratio))
        if longest > positions:
            raise WorkloadError("serve.source.range_ratio", src.range_ratio, f"the longest request ({longest} tokens) "
                                f"must fit model.max_position_embeddings={positions}")
    elif src.kind == "shared_prefix":
        if src.prefixes * src.suffixes < needed:
            raise WorkloadError("serve.source.suffixes", src.suffixes, f"prefixes x suffixes = "
                                f"{src.prefixes * src.suffixes} prompts, fewer than the {needed} requests "
                                "(serve.requests + serve.warmup_requests)")
        longest = src.prefix_len + src.suffix_len + output_high
        if longest > positions:
            raise WorkloadError("serve.source.prefix_len", src.prefix_len, f"prefix + suffix + output ({longest} "
                                f"tokens) must fit model.max_position_embeddings={positions}")
    elif src.kind == "multi_turn" and not src.path:
        longest = src.turns * (input_high + output_high)
        if longest > positions:
            raise WorkloadError("serve.source.turns", src.turns, f"the last turn carries {longest} tokens of history "
                                f"and answer: it must fit model.max_position_embeddings={positions}")
    elif src.kind == "mooncake":
        if len(rows) < needed:
            raise WorkloadError("serve.requests", s.requests, f"the trace has {len(rows)} requests: serve.requests + "
                                f"serve.warmup_requests ({needed}) must not exceed them")
        for number, row in enumerate(rows[:needed], 1):
            if row["input_length"] + row["output_length"] > positions:
                raise WorkloadError("serve.source.path", src.path, f"request {number} of the trace "
                                    f"({row['input_length']} + {row['output_length']} tokens) does not fit "
                                    f"model.max_position_embeddings={positions}")
