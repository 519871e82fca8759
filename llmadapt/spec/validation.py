"""The rules across fields of a workload (``check_workload``, run whenever a Workload is built), and the checks of
the files it names (JSONL data and evaluation sets, request-stream files), so that a wrong workload fails in one line
before anything starts. A field's own check is its validator (``llmadapt.spec.fields``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from llmadapt.dataformats import problem as format_problem
from llmadapt.errors import WorkloadError, not_a_file
from llmadapt.spec.data import DataSpec
from llmadapt.spec.serving import LengthSpec
from llmadapt.spec.training import LORA_TARGETS


def check_workload(w) -> None:
    """Cross-field rules of the Workload ``w`` (untyped here: llmadapt.spec.workload imports this module); each
    failure names one field."""
    p, t, o = w.parallelism, w.train, w.optimizations
    if t.global_batch % p.dp:
        raise WorkloadError("train.global_batch", t.global_batch, f"must be divisible by parallelism.dp={p.dp}")
    if t.micro_batch is not None:
        if t.micro_batch < 1 or w.per_rank_batch % t.micro_batch:
            raise WorkloadError(
                "train.micro_batch", t.micro_batch,
                f"must divide the per-rank batch global_batch/dp = {w.per_rank_batch}",
            )
    if t.seq_len > w.model.max_position_embeddings:
        raise WorkloadError(
            "train.seq_len", t.seq_len, f"must be <= model.max_position_embeddings={w.model.max_position_embeddings}"
        )
    if w.model.num_heads % p.tp or w.model.num_kv_heads % p.tp:
        raise WorkloadError(
            "parallelism.tp", p.tp,
            f"must divide model.num_heads={w.model.num_heads} and model.num_kv_heads={w.model.num_kv_heads}",
        )
    if p.pp > w.model.num_layers:
        raise WorkloadError("parallelism.pp", p.pp, f"must be <= model.num_layers={w.model.num_layers}")
    if p.ep > 1:
        if not w.model.is_moe:
            raise WorkloadError("parallelism.ep", p.ep, "expert parallelism needs an MoE model (model.num_experts > 0)")
        if w.model.num_experts % p.ep:
            raise WorkloadError("parallelism.ep", p.ep, f"must divide model.num_experts={w.model.num_experts}")
        if (p.dp * p.tp) % p.ep:
            raise WorkloadError("parallelism.ep", p.ep, f"must divide dp*tp={p.dp * p.tp}")
    if w.profile.steps:
        if w.kind == "serve":
            raise WorkloadError("profile.steps", list(w.profile.steps), "profiling is for train and finetune workloads")
        first, last = t.warmup_steps, t.total_steps - 1
        for i in w.profile.steps:
            if not first <= i <= last:
                raise WorkloadError("profile.steps", list(w.profile.steps),
                                    f"step {i} is not a measured step: measured steps are {first}..{last} "
                                    f"(after train.warmup_steps={t.warmup_steps})")
        if len(set(w.profile.steps)) != len(w.profile.steps):
            raise WorkloadError("profile.steps", list(w.profile.steps), "names a step twice")
    if t.optimizer_impl == "cpu_adam" and t.optimizer == "sgd":
        raise WorkloadError("train.optimizer_impl", t.optimizer_impl, "cpu_adam needs train.optimizer adam or adamw")
    if o.offload == "optimizer" and o.zero_stage == 0:
        raise WorkloadError("optimizations.offload", o.offload, "optimizer offload needs optimizations.zero_stage >= 1")
    if o.offload == "optimizer+params" and o.zero_stage != 3:
        raise WorkloadError("optimizations.offload", o.offload, "parameter offload needs optimizations.zero_stage = 3")
    if w.lora.rank and w.kind != "finetune":
        raise WorkloadError("lora.rank", w.lora.rank, "LoRA needs kind = 'finetune'")
    if not w.lora.dropout < 1:
        raise WorkloadError("lora.dropout", w.lora.dropout, "must be in [0, 1)")
    if w.lora.rank:
        known = LORA_TARGETS[w.model.family]
        if not w.lora.target_modules:
            raise WorkloadError("lora.target_modules", [], f"name at least one of: {', '.join(known)}")
        wrong = [m for m in w.lora.target_modules if m not in known]
        if wrong:
            raise WorkloadError("lora.target_modules", wrong[0][:40],
                                f"not a linear layer of a {w.model.family} model; known: {', '.join(known)}")
    if o.quantization != "none" and not w.lora.rank:
        raise WorkloadError(
            "optimizations.quantization", o.quantization, "quantized base weights do not train: set lora.rank > 0 (QLoRA)"
        )
    if w.save.path is not None and w.kind == "serve":
        raise WorkloadError("save.path", w.save.path, "saving the trained model is for train and finetune workloads")
    if w.save.lora == "adapter" and not w.lora.rank:
        raise WorkloadError("save.lora", w.save.lora, "'adapter' saves a LoRA adapter: needs lora.rank > 0")
    if w.kind == "serve":
        _check_serve(w)
    if w.data.packing:
        _check_packing(w)
    rows = None
    if w.data.source == "jsonl":
        if not w.data.path:
            raise WorkloadError("data.path", w.data.path, "data.source = 'jsonl' needs a path to a JSONL file")
        if not Path(w.data.path).is_file():
            raise WorkloadError("data.path", w.data.path, not_a_file(w.data.path))
        if w.data.format == "sharegpt":
            rows = _check_sharegpt(w.data.path, "data.path")
        else:
            # held-out rows are scored as eval says (eval.format without eval.path is refused below)
            held_here = bool(w.eval.examples) and w.eval.path is None and w.eval.format is None
            rows = _check_jsonl(w.data, w.data.path, "data.path",
                                number=held_here and w.eval.resolved_match(w.data.format) == "number")
    if "sharegpt" in (w.data.format, w.eval.format):
        _check_chats(w)
    _check_eval(w, rows)


def _check_chats(w) -> None:
    """Conversations (data.format or eval.format 'sharegpt') are trained on and scored token by token."""
    if w.kind == "serve":
        raise WorkloadError("data.format", "sharegpt", "conversations are training data: a serve workload reads a "
                            "ShareGPT file as serve.source.kind = 'sharegpt'")
    if w.eval.match == "number":
        raise WorkloadError("eval.match", "number", "conversations have no final number to match: use 'tokens'")


def _check_sharegpt(path: str, field_name: str) -> int:
    """A ShareGPT file (one JSON list of conversations): its layout checked, in one line naming the entry.
    Returns the number of conversations with at least one human/gpt exchange."""
    from llmadapt.streamfiles import read_sharegpt

    try:
        return sum(1 for pairs in read_sharegpt(path) if pairs)
    except ValueError as exc:
        raise WorkloadError(field_name, path, f"{exc} (data.format 'sharegpt')") from None


def _check_packing(w) -> None:
    if w.kind == "serve":
        raise WorkloadError("data.packing", True, "packing is for train and finetune workloads")
    if w.data.source != "jsonl":
        raise WorkloadError("data.packing", True, "needs data.source = 'jsonl' (synthetic samples fill train.seq_len: "
                                                  "nothing to pack)")
    if w.model.family == "jamba":
        raise WorkloadError("data.packing", True, "family 'jamba' cannot keep a packed row's samples apart (its Mamba "
                                                  "layers carry state from one sample into the next; no mask stops "
                                                  "that): use family llama or mixtral, or data.packing = false")


def _check_eval(w, data_rows: int | None) -> None:
    e = w.eval
    if not e.examples:
        for name in ("path", "every", "share"):
            if getattr(e, name):
                raise WorkloadError(f"eval.{name}", getattr(e, name), "needs eval.examples > 0 (how many to evaluate)")
        return
    if e.share:
        _check_share(w, data_rows)
        return
    if w.kind == "serve":
        raise WorkloadError("eval.examples", e.examples, "evaluation is for train and finetune workloads")
    if e.path is not None and (e.format or w.data.format) == "sharegpt":
        if not Path(e.path).is_file():
            raise WorkloadError("eval.path", e.path, not_a_file(e.path))
        rows = _check_sharegpt(e.path, "eval.path")
        if e.examples > rows:
            raise WorkloadError("eval.examples", e.examples, f"more than the {rows} conversations in eval.path")
    elif e.path is not None:
        if not Path(e.path).is_file():
            raise WorkloadError("eval.path", e.path, not_a_file(e.path))
        rows = _check_jsonl(w.data, e.path, "eval.path", choices=True, fmt=e.format or w.data.format,
                            number=e.resolved_match(w.data.format) == "number")
        if e.examples > rows:
            raise WorkloadError("eval.examples", e.examples, f"more than the {rows} examples in eval.path")
    elif e.format is not None:
        raise WorkloadError("eval.format", e.format, "is the layout of eval.path: held-out rows of data.path are "
                            "read with data.format")
    elif data_rows is not None and e.examples >= data_rows:
        raise WorkloadError("eval.examples", e.examples, f"holds out too many of data.path's {data_rows} examples: "
                            "training needs at least one (or give eval.path)")


def _check_share(w, data_rows: int | None) -> None:
    """eval.share: a content-hash split of data.path that leaves rows on both sides."""
    e = w.eval
    if not e.share < 1:
        raise WorkloadError("eval.share", e.share, "must be below 1 (the share of data.path held out of training)")
    if e.path is not None or w.data.source != "jsonl":
        raise WorkloadError("eval.share", e.share, "holds out rows of data.path (data.source = 'jsonl'), not with "
                            "eval.path")
    if e.format is not None:
        raise WorkloadError("eval.format", e.format, "is the layout of eval.path: held-out rows of data.path are "
                            "read with data.format")
    stat = Path(w.data.path).stat()
    held, rows = _held_out_count(w.data.path, stat.st_size, stat.st_mtime_ns, w.data.format, e.share)
    if not held:
        raise WorkloadError("eval.share", e.share, f"holds out none of data.path's {data_rows} examples (by content "
                            "hash): raise it")
    if held == rows:
        raise WorkloadError("eval.share", e.share, f"holds out all of data.path's {data_rows} examples (by content "
                            "hash): training needs at least one")


@functools.lru_cache(maxsize=8)
def _held_out_count(path: str, size: int, mtime: int, fmt: str, share: float) -> tuple[int, int]:
    """How many of the file's rows eval.share holds out, of how many: cached by the file's size and time, as a
    workload is built again for every override and adapter."""
    from llmadapt.dataformats import held_out

    if fmt == "sharegpt":
        from llmadapt.streamfiles import read_sharegpt

        contents = [pairs for pairs in read_sharegpt(path) if pairs]
    else:
        contents = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return sum(held_out(c, share) for c in contents), len(contents)


def _check_jsonl(d: DataSpec, path: str, field_name: str, choices: bool = False, fmt: str | None = None,
                 number: bool = False) -> int:
    """Every line an object with the fields its format needs (llmadapt.dataformats; for evaluation, a prompt-answer
    row's optional ``choices`` list of texts holding the answer; for exact match on the final number, an answer
    with a number): checked here, not minutes later, in one line naming the file and the line. Returns the
    number of examples."""
    from llmadapt.dataformats import parse

    fmt = fmt or d.format
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(field_name, path, f"cannot be read as UTF-8 text: {exc}") from None
    rows = 0
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(field_name, path, f"line {line_no} is not JSON ({exc.msg})") from None
        wrong = format_problem(row, fmt, d.prompt_field, d.answer_field, choices)
        if wrong is None and number and parse(row, fmt, d.prompt_field, d.answer_field).number is None:
            wrong = "has no number in its answer (exact match on the final number: eval.match = 'number')"
        if wrong is not None:
            raise WorkloadError(field_name, path, f"line {line_no}: {wrong}")
        rows += 1
    if not rows:
        raise WorkloadError(field_name, path, "has no examples (the file is empty)")
    return rows


def _check_serve(w) -> None:
    s = w.serve
    if s.mode == "offline" and s.url is not None:
        raise WorkloadError("serve.mode", s.mode, "offline runs the engine's offline API here: not with serve.url")
    if s.mode == "offline" and not s.ignore_eos:  # the offline engines force lengths: recorded as forced
        raise WorkloadError("serve.ignore_eos", False, "serve.mode = 'offline' forces every output length (its "
                            "engines generate exactly the tokens asked): stop at end-of-sequence in an online run")
    if s.mode == "offline" and s.profile:
        raise WorkloadError("serve.profile", True, "the engine's profile is of its server (serve.mode = 'online')")
    if s.quality.texts and (s.url or s.mode == "offline"):
        raise WorkloadError("serve.quality.texts", s.quality.texts, "the quality probe asks a server llmadapt starts, "
                            "whose checkpoint the fp32 reference loads: not with serve.url or serve.mode = 'offline'")
    if s.url is not None and s.engine.given():
        name, value = next(iter(s.engine.given().items()))
        raise WorkloadError(f"serve.engine.{name}", value, "an attached engine (serve.url) runs with the arguments "
                            "it was started with: set them where it is started")
    if s.url is not None:
        from urllib.parse import urlsplit

        parts = urlsplit(s.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WorkloadError("serve.url", s.url[:80], "must be an http:// or https:// URL with a host")
    for name in ("input_len", "output_len"):
        spec: LengthSpec = getattr(s, name)
        if spec.low > spec.high:
            raise WorkloadError(f"serve.{name}.low", spec.low, f"must be <= serve.{name}.high={spec.high}")
        if spec.dist == "dataset" and w.data.source != "jsonl":
            raise WorkloadError(f"serve.{name}.dist", "dataset", "needs data.source = 'jsonl' with a data.path")
    longest = s.input_len.high if s.input_len.dist != "fixed" else s.input_len.mean
    longest += s.output_len.high if s.output_len.dist != "fixed" else s.output_len.mean
    if longest > w.model.max_position_embeddings:
        raise WorkloadError("serve.input_len", longest, f"input + output tokens must fit "
                            f"model.max_position_embeddings={w.model.max_position_embeddings}")
    if s.arrival.process == "trace":
        if not s.arrival.trace or not Path(s.arrival.trace).is_file():
            raise WorkloadError("serve.arrival.trace", s.arrival.trace, "process 'trace' needs an existing JSONL file")
    elif s.arrival.process != "closed" and s.arrival.rate <= 0:
        raise WorkloadError("serve.arrival.rate", s.arrival.rate, "must be > 0 for open-loop arrivals")
    if s.arrival.process == "gamma" and s.arrival.burstiness <= 0:
        raise WorkloadError("serve.arrival.burstiness", s.arrival.burstiness, "must be > 0")
    if s.source.kind != "synthetic":
        from llmadapt.streamfiles import check_source

        check_source(w)
