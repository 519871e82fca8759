"""What a role class is given: the worker context (workload, place, device, checkpoint) and the step's
batch; for servers, the serve context, the planned requests and the chunks a stream yields.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import attrs

from llmadapt.contract.records import Phase, Span
from llmadapt.spec import Workload


@attrs.define
class WorkerContext:
    """What a role class gets: the workload, its place, the device and the canonical checkpoint."""

    workload: Workload
    rank: int
    local_rank: int
    world_size: int
    device: Any  # torch.device
    checkpoint: Path
    run_dir: Path

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        """Wait for queued device work: call before reading any clock."""
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str, into: list[Phase], source: str = "llmadapt", *, spans: list[Span] | None = None,
              span: str | None = None, span_source: str | None = None) -> Iterator[None]:
        """Time a part of a step on the monotonic clock, device-synchronised at both ends.

        The seconds go to ``into``: added to the phase of this name and source already there (a part timed once
        per micro-batch is one phase of the step), else appended as a new one. Given ``spans``, the same interval
        is appended there as a Span named ``span`` (default: ``name``) from ``span_source`` (default:
        ``source``), for the step's timeline."""
        self.synchronize()
        start = time.monotonic_ns()
        yield
        self.synchronize()
        end = time.monotonic_ns()
        seconds = (end - start) / 1e9
        for i, known in enumerate(into):
            if known.name == name and known.source == source:
                into[i] = Phase(name=name, seconds=known.seconds + seconds, source=source)
                break
        else:
            into.append(Phase(name=name, seconds=seconds, source=source))
        if spans is not None:
            spans.append(Span(span or name, start, end, span_source or source))


IGNORE = -100


@attrs.frozen
class Sample:
    """One training sample: ``seq_len`` token ids and ``seq_len`` labels, padded after ``length`` real
    tokens. Labels are already shifted: ``labels[t]`` is the token that follows ``input_ids[t]``. They are
    ``IGNORE`` on padding and, for instruction data, where the next token is still the prompt's."""

    input_ids: list[int]
    labels: list[int]
    length: int  # tokens before padding


@attrs.frozen
class MicroBatch:
    """One micro-batch, on the CPU (move it to ``ctx.device``): ``input_ids`` and ``labels`` are int64
    tensors of shape ``[micro_batch, seq_len]``. Labels are already shifted (``labels[:, t]`` follows
    ``input_ids[:, t]``): compute cross-entropy of the logits against them directly, with
    ``ignore_index=IGNORE`` (-100), and do not pass them to a Hugging Face model's ``labels=``, which shifts
    again. Unpacked, there is no attention mask: padding only follows a sample's real tokens, and a causal model
    never attends forward, so the real tokens' logits are those of the unpadded sample.

    Packed (``data.packing``), each row holds several samples: ``segment_ids`` says which (1, 2, ... in row order;
    0 for the padding at the row's end) and ``position_ids`` restart at 0 with each sample. A sample's tokens
    must attend only to earlier tokens of the same sample: pass ``model_inputs`` to a Hugging Face causal LM, or
    build the model's own mask from ``attention_allowed``. Labels never cross a sample boundary (each sample's
    last label is its own last token), so the loss needs nothing more."""

    input_ids: Any  # LongTensor [micro_batch, seq_len]
    labels: Any  # LongTensor [micro_batch, seq_len], IGNORE = no loss
    position_ids: Any = None
    """Packed rows only: LongTensor [micro_batch, seq_len], 0, 1, ... within each sample; None unpacked."""
    segment_ids: Any = None
    """Packed rows only: LongTensor [micro_batch, seq_len], the token's sample in its row (1, 2, ...), 0 on padding."""

    @property
    def packed(self) -> bool:
        return self.segment_ids is not None

    def attention_allowed(self, device=None):
        """Bool ``[micro_batch, 1, seq_len, seq_len]``: True where query token t may attend key token k (the same
        sample and k <= t): block-diagonal and causal. None for unpacked rows (plain causal attention is right)."""
        if self.segment_ids is None:
            return None
        import torch

        seg = self.segment_ids.to(device)
        n = seg.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=seg.device).tril()
        return (seg[:, None, :, None] == seg[:, None, None, :]) & causal

    def model_inputs(self, device, dtype) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM (transformers 4.51 and 5.x, eager and SDPA attention):
        ``input_ids``, and for packed rows the 4D additive ``attention_mask`` (0 where allowed, the dtype's minimum
        elsewhere; transformers uses a 4D mask as given) and ``position_ids``. ``dtype`` is the attention's (the
        model's compute dtype): SDPA refuses a float mask of another dtype."""
        out = {"input_ids": self.input_ids.to(device)}
        if self.segment_ids is not None:
            import torch

            allowed = self.attention_allowed(device)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
            out["attention_mask"] = mask.masked_fill_(~allowed, torch.finfo(dtype).min)
            out["position_ids"] = self.position_ids.to(device)
        return out


@attrs.frozen
class StepBatch:
    """This rank's share of one global step."""

    step: int
    micro_batches: list[MicroBatch]
    loss_tokens_global: int
    """Loss-bearing tokens in the whole global batch: the loss normalizer on every rank."""
    tokens: int
    """Input tokens (padding excluded) in this rank's share."""
    samples: int
    """Samples (prompt and answer: queries) in this rank's share; packed, those inside its rows."""
    sample_length_squares: int | None = None
    """Sum of its samples' real lengths squared (the attention term's context: llmadapt.contract.flops)."""


@attrs.frozen
class PlannedRequest:
    """One request of a serving run's plan, the same for every engine: its prompt (text and the token ids
    the canonical tokenizer gives it), how many tokens to ask for, and when it is due."""

    index: int
    warmup: bool
    offset_s: float | None
    """Due time after the schedule's start (open loop); None in a closed loop."""
    prompt: str
    prompt_token_ids: list[int]
    input_tokens: int
    output_tokens: int
    ignore_eos: bool
    api: str


@attrs.frozen
class Chunk:
    """One piece of a streamed response as the adapter parsed it."""

    text: str = ""
    tokens: int | None = None
    """Tokens in this chunk when the protocol says; None when it does not."""
    finish_reason: str | None = None
    usage_output_tokens: int | None = None
    usage_input_tokens: int | None = None


class RequestFailed(Exception):
    """Raised by a Server's stream for a failed request; ``cause`` is counted in the summary."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class WrongServer(Exception):
    """Raised by ``Server.ready`` when what answers is not the engine the adapter speaks to (an HTML page, JSON
    of another shape): waiting will not change that, so the run fails at once with this one-line message."""


@attrs.define
class ServeContext:
    """What a ``Server`` is given: the workload, where to write (``run_dir``: engine.log goes there), the
    environment's interpreter to start the engine with, the checkpoint to serve, and the port to listen on."""

    workload: Workload
    adapter: str
    run_dir: Path
    python: Path | None
    """Interpreter of the adapter's environment (to start the engine); None when attaching."""
    checkpoint: Path | None
    """The canonical checkpoint to serve; None when attaching to a server of another model."""
    port: int
    env: dict[str, str] | None = None
    """Environment variables for a process started with ``python`` whose code imports llmadapt or the adapter's
    own package (PYTHONPATH names their sources); None: this process's environment."""

    @property
    def base_url(self) -> str:
        return (self.workload.serve.url or f"http://127.0.0.1:{self.port}").rstrip("/")


_VERSIONS = """
import json, sys
from importlib import metadata
out = {}
for name in json.loads(sys.argv[1]):
    try:
        out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def installed_versions(python: Path | str, names: list[str]) -> dict[str, str | None]:
    """The installed version of each distribution in the environment of ``python`` (None: absent), without
    importing any of them there (fast). Raises RuntimeError, with what the interpreter said, if it cannot run."""
    import json
    import subprocess

    out = subprocess.run([str(python), "-c", _VERSIONS, json.dumps(names)], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(out.stderr.strip()[-300:] or f"{python} exited with {out.returncode}")
    return json.loads(out.stdout)


def engine_popen_options() -> dict[str, Any]:
    """``subprocess.Popen`` options for an engine an adapter starts: its own process group (``stop`` signals the
    group), in this process's session, with no terminal input.

    Not a session of its own (``start_new_session``): with Linux's autogroup scheduling, on by default in most
    distributions, every session is a task group with an equal share of the CPUs. A busy engine in a session of
    its own left the light, bursty load generator waiting runnable for a CPU for up to 0.9 s at 30 req/s on 2
    cores, while the engine's group kept its share; in one session, each thread competes for itself and the
    client's wake-ups preempt (measured: docs/serving.md, "The client beside a busy engine").
    """
    import subprocess

    if sys.version_info >= (3, 11):
        return {"process_group": 0, "stdin": subprocess.DEVNULL}
    return {"preexec_fn": os.setpgrp, "stdin": subprocess.DEVNULL}


CHILDREN_GRACE_S = 5.0


def stop_engine(proc, grace_s: float) -> None:
    """Stop an engine started with ``engine_popen_options`` and return only when nothing of its group is left.

    SIGTERM goes to the engine only (it shuts its own children down; a SIGTERM to a whole vLLM group at once was
    seen to hang); after ``grace_s``, or CHILDREN_GRACE_S after the engine exited, whatever of the group is
    still there gets SIGKILL. A killed child may take a
    moment to die, and a caller that looks at once must not find it: hence the wait for the group to empty.
    """
    import signal
    import subprocess

    pgid = proc.pid
    deadline = time.monotonic() + grace_s
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = min(deadline, time.monotonic() + CHILDREN_GRACE_S)  # the engine is gone: its children follow or not
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # in uninterruptible sleep: nothing more a signal can do
        pass
    deadline = time.monotonic() + 10
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group, from /proc (Linux)."""
    return [pid for pid, fields in group_stats(pgid).items() if fields[0] != "Z"]


def group_stats(pgid: int) -> dict[int, list[str]]:
    """The processes of a process group (zombies included), each with its /proc stat fields after the command
    name: state ppid pgrp ... utime stime cutime cstime (Linux)."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            out[int(p.name)] = fields
    return out
