"""Request streams (serve.source): what the load generator sent, as the server received it (tests/fake_openai.py
--log), checked against the file the stream was read from, and the checks that refuse a bad file before
anything starts. Sample files: examples/data/stream_samples.py."""

import importlib.util
import json
from pathlib import Path

import pytest

from llmadapt import Workload, run
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.errors import WorkloadError
from llmadapt.models import train_tokenizer
from llmadapt.runtime.requests import plan_requests

HERE = Path(__file__).parent
SAMPLES = HERE.parent / "examples" / "data" / "stream_samples.py"

pytest.importorskip("aiohttp")
pytest.importorskip("llmadapt_openai", reason="the openai adapter package is not installed (pip install -e plugins/openai)")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(512)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The sample files, written by the repository's script into a fresh folder."""
    spec = importlib.util.spec_from_file_location("stream_samples", SAMPLES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sharegpt, prompts, mooncake = module.write(tmp_path_factory.mktemp("streams"))
    return {"sharegpt": sharegpt, "prompts": prompts, "mooncake": mooncake}


def workload(source, **serve):
    base = {"requests": 6, "warmup_requests": 1, "output_len": {"mean": 5}, "request_timeout_s": 5.0,
            "arrival": {"process": "constant", "rate": 40.0}, "scrape_interval_s": 0.2, "source": source}
    for key, value in serve.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return Workload.from_dict({"kind": "serve", "model": {"preset": "tiny-llama"}, "serve": base})


def served(tmp_path, local_server, w, *server_args):
    """Run ``w`` against the fake server: (requests received, in arrival order; request records, by index)."""
    log = tmp_path / "received.jsonl"
    url, _ = local_server("fake_openai.py", "--log", str(log), *server_args)
    w = w.with_overrides([f"serve.url={url}"])
    result = run(w, "openai", out=tmp_path / "runs")
    assert result.ok, result.summary.failures
    records = sorted((r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "request"),
                     key=lambda r: r["index"])
    received = [json.loads(line) for line in log.read_text().splitlines()]
    return received, records


def count(tok, text):
    return len(tok.encode(text, add_special_tokens=False).ids)


def check_sent(received, records, plan, ordered=True):
    """The server received the plan's prompts and output lengths (in order, unless conversations interleave);
    the records say the same lengths."""
    got = [(r["body"]["prompt"], r["body"]["max_tokens"]) for r in received]
    want = [(p.prompt, p.output_tokens) for p in plan]
    assert got == want if ordered else sorted(got) == sorted(want)
    assert [(r["input_tokens"], r["requested_output_tokens"]) for r in records] == [
        (p.input_tokens, p.output_tokens) for p in plan]


# -- each kind, as sent ---------------------------------------------------------------------------
def test_sharegpt_sends_first_human_turns_with_their_answers_lengths(tmp_path, local_server, files, tok):
    w = workload({"kind": "sharegpt", "path": str(files["sharegpt"]), "max_input_len": 40})
    received, records = served(tmp_path, local_server, w)
    plan = plan_requests(w, tok)
    check_sent(received, records, plan)
    answers = {}
    for entry in json.loads(files["sharegpt"].read_text()):
        turns = entry["conversations"]
        if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt":
            answers[turns[0]["value"]] = count(tok, turns[1]["value"])
    for r in received:  # every prompt is a conversation's first human turn; its length, that turn's answer's
        assert answers[r["body"]["prompt"]] == r["body"]["max_tokens"]
        assert count(tok, r["body"]["prompt"]) <= 40  # the length filter
    assert len({r["body"]["prompt"] for r in received}) == 7  # drawn without replacement
    assert [p.prompt for p in plan_requests(w.with_overrides(["seed=1"]), tok)] != [p.prompt for p in plan]


def test_prompts_file_answers_give_output_lengths(tmp_path, local_server, files, tok):
    w = workload({"kind": "prompts", "path": str(files["prompts"])}, requests=9)
    received, records = served(tmp_path, local_server, w)
    check_sent(received, records, plan_requests(w, tok))
    rows = {r["prompt"]: r.get("answer") for r in map(json.loads, files["prompts"].read_text().splitlines())}
    assert sorted(r["body"]["prompt"] for r in received) == sorted(rows)  # all ten, once each
    for r in received:
        answer = rows[r["body"]["prompt"]]
        assert r["body"]["max_tokens"] == (count(tok, answer) if answer else 5)  # no answer: serve.output_len


def test_random_stream_stays_within_the_range_ratio(tmp_path, local_server, tok):
    w = workload({"kind": "random", "range_ratio": 0.5}, input_len={"mean": 20}, output_len={"mean": 8})
    received, records = served(tmp_path, local_server, w)
    check_sent(received, records, plan_requests(w, tok))
    for r in records:
        assert 10 <= r["input_tokens"] <= 30 and 4 <= r["requested_output_tokens"] <= 12
    many = plan_requests(w.with_overrides(["serve.requests=300"]), tok)
    assert {p.input_tokens for p in many} == set(range(10, 31)) and {p.output_tokens for p in many} == set(range(4, 13))


def test_shared_prefix_stream_sends_n_prefixes_with_m_suffixes_each(tmp_path, local_server, tok):
    source = {"kind": "shared_prefix", "prefixes": 2, "suffixes": 4, "prefix_len": 12, "suffix_len": 3}
    w = workload(source, requests=7)
    received, records = served(tmp_path, local_server, w)
    check_sent(received, records, plan_requests(w, tok))
    ids = [tok.encode(r["body"]["prompt"], add_special_tokens=False).ids for r in received]
    assert all(len(i) == 15 for i in ids)
    groups = {}
    for i in ids:
        groups.setdefault(tuple(i[:12]), set()).add(tuple(i[12:]))
    assert len(groups) == 2 and sorted(map(len, groups.values())) == [4, 4]  # 2 x 4: every prompt sent once


def test_multi_turn_carries_the_history_and_waits_for_the_answer_and_think_time(tmp_path, local_server, files,
                                                                                 tok):
    source = {"kind": "multi_turn", "path": str(files["sharegpt"]), "think_s": 0.05}
    w = workload(source, requests=8)
    received, records = served(tmp_path, local_server, w, "--token-ms", "2")
    plan = plan_requests(w, tok)
    check_sent(received, records, plan, ordered=False)
    convs = [[(t["value"], u["value"]) for t, u in zip(e["conversations"][::2], e["conversations"][1::2])]
             for e in json.loads(files["sharegpt"].read_text())]
    steps = {c[k - 1][1] + "\n" + c[k][0] for c in convs for k in range(1, len(c))}  # an answer, the next question
    assert max(p.turn for p in plan) >= 1
    for p, r in zip(plan, records):
        if p.turn:  # the previous turn's prompt, the file's answer to it and this turn's question
            before = plan[p.index - 1]
            assert before.conversation == p.conversation and before.turn == p.turn - 1
            assert p.prompt.startswith(before.prompt + "\n") and p.prompt[len(before.prompt) + 1:] in steps
            assert r["sent_ns"] - records[p.index - 1]["end_ns"] >= 0.05e9  # answer ended, then the think time
        else:
            assert any(c and c[0][0] == p.prompt for c in convs)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_mooncake_trace_is_replayed_at_its_timestamps_with_its_shared_blocks(tmp_path, local_server, files, tok,
                                                                            scale):
    source = {"kind": "mooncake", "path": str(files["mooncake"]), "block_size": 8, "time_scale": scale}
    w = workload(source, requests=9)
    received, records = served(tmp_path, local_server, w)
    check_sent(received, records, plan_requests(w, tok))
    rows = [json.loads(line) for line in files["mooncake"].read_text().splitlines()]
    assert [(r["input_tokens"], r["requested_output_tokens"]) for r in records] == [
        (row["input_length"], row["output_length"]) for row in rows]
    sent = [(r["sent_ns"] - records[0]["scheduled_ns"]) / 1e9 for r in records]
    due = [(row["timestamp"] - rows[0]["timestamp"]) / 1000 * scale for row in rows]
    assert [r["scheduled_ns"] - records[0]["scheduled_ns"] for r in records] == pytest.approx(
        [d * 1e9 for d in due], abs=1e3)  # scheduled at the trace's times (to the ns rounding)
    assert all(0 <= s - d < 0.05 for s, d in zip(sent, due)), (sent, due)  # sent then (a loaded machine's lag)
    ids = [tok.encode(r["body"]["prompt"], add_special_tokens=False).ids for r in received]
    for a, b in [(1, 3)]:  # both start with hash id 0: the same first block of 8 tokens, then different ones
        assert rows[a]["hash_ids"][0] == rows[b]["hash_ids"][0] and ids[a][:8] == ids[b][:8]
        assert rows[a]["hash_ids"][1] != rows[b]["hash_ids"][1] and ids[a][8:16] != ids[b][8:16]


# -- planning and the spec ----------------------------------------------------------------------
def test_multi_turn_without_a_file_and_closed_loop_plan(tok):
    w = workload({"kind": "multi_turn", "turns": 3}, requests=6, input_len={"mean": 4}, output_len={"mean": 3},
                 arrival={"process": "closed", "concurrency": 2})
    plan = plan_requests(w, tok)
    assert [(p.conversation, p.turn) for p in plan] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert [p.input_tokens for p in plan[:3]] == [4, 4 + 3 + 4, 4 + 3 + 4 + 3 + 4]


def test_the_default_source_leaves_the_hashes_as_they_were():
    w = workload({})
    assert "source" not in w.problem_dict()["serve"]
    assert w.content_hash == workload({"kind": "synthetic"}).content_hash
    assert workload({"kind": "random", "range_ratio": 0.2}).content_hash != w.content_hash


def test_too_few_entries_within_the_filters_is_refused_before_sending(files, tok):
    from llmadapt.errors import LlmadaptError

    w = workload({"kind": "sharegpt", "path": str(files["sharegpt"]), "min_input_len": 30}, requests=8)
    with pytest.raises(LlmadaptError, match=r"of the file's 10 entries are within the length filters"):
        plan_requests(w, tok)


@pytest.mark.parametrize("source, content, message", [
    ({"kind": "sharegpt"}, '[{"conversations": [{"from": "human", "value": "hi"}]}, {"turns": []}]',
     'entry 1 has no "conversations" list'),
    ({"kind": "sharegpt"}, '[{"conversations": [{"from": "human", "text": "hi"}]}]',
     'entry 0, turn 0 needs a text "from" and a text "value"'),
    ({"kind": "sharegpt"}, '{"conversations": []}', "must be a JSON list of conversations"),
    ({"kind": "prompts"}, '{"prompt": "a"}\n{"text": "b"}\n', "line 2 needs a text field 'prompt'"),
    ({"kind": "mooncake"}, '{"timestamp": 10, "input_length": 4, "output_length": 2}\n'
                           '{"timestamp": 5, "input_length": 4, "output_length": 2}\n',
     "line 2: timestamp 5 ms is before the previous line's 10 ms"),
    ({"kind": "mooncake"}, '{"timestamp": 10, "input_length": 4}\n', "line 1 needs 'output_length'"),
    ({"kind": "mooncake"}, '{"timestamp": 0, "input_length": 200, "output_length": 100}\n' * 8,
     "request 1 of the trace .200 \\+ 100 tokens. does not fit"),
])
def test_a_file_without_what_its_layout_needs_is_refused_in_one_line(tmp_path, source, content, message):
    path = tmp_path / "stream.json"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=message) as err:
        workload({**source, "path": str(path)})
    assert "serve.source.path" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("source, field, message", [
    ({"kind": "sharegpt2"}, "serve.source.kind", "allowed: synthetic, sharegpt"),
    ({"kind": "sharegpt"}, "serve.source.path", "reads a file: give its path"),
    ({"kind": "prompts", "path": "/nonexistent.jsonl"}, "serve.source.path", "no such file"),
    ({"kind": "random", "prefixes": 4}, "serve.source.prefixes", "is not read by kind 'random' .only by shared_prefix"),
    ({"kind": "random", "range_ratio": 1.0}, "serve.source.range_ratio", "must be below 1"),
    ({"kind": "shared_prefix", "prefixes": 2, "suffixes": 2}, "serve.source.suffixes", "fewer than the 7 requests"),
    ({"kind": "multi_turn", "turns": 20}, "serve.source.turns", "must fit model.max_position_embeddings=256"),
])
def test_bad_sources_are_refused_in_one_line(source, field, message):
    with pytest.raises(WorkloadError, match=message) as err:
        workload(source)
    assert str(err.value).startswith(field) or field in str(err.value)


def test_a_relative_path_in_a_workload_file_is_read_next_to_it(tmp_path, files):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "trace.jsonl").write_text(files["mooncake"].read_text())
    (tmp_path / "w.toml").write_text('kind = "serve"\n[serve]\nrequests = 8\n[serve.source]\nkind = "mooncake"\n'
                                     'path = "data/trace.jsonl"\nblock_size = 8\n')
    w = Workload.from_file(tmp_path / "w.toml")
    assert w.serve.source.path == str(tmp_path / "data" / "trace.jsonl")


def test_multi_turn_in_a_closed_loop_keeps_concurrency_conversations_going(tmp_path, local_server, tok):
    w = workload({"kind": "multi_turn", "turns": 3, "think_s": 0.02}, requests=8, input_len={"mean": 4},
                 output_len={"mean": 3}, arrival={"process": "closed", "concurrency": 2})
    received, records = served(tmp_path, local_server, w, "--token-ms", "2")
    plan = plan_requests(w, tok)
    check_sent(received, records, plan, ordered=False)
    for p, r in zip(plan, records):
        if p.turn:
            assert r["sent_ns"] - records[p.index - 1]["end_ns"] >= 0.02e9
    firsts = sorted(r["sent_ns"] for p, r in zip(plan, records) if p.turn == 0)
    ends = {p.conversation: r["end_ns"] for p, r in zip(plan, records)}  # the last turn's end, by conversation
    assert firsts[2] >= min(ends[0], ends[1])  # the third conversation waited for a slot
