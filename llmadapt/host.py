"""Facts about this process and machine that every layer needs: the release, the state folder, the clock,
the node's name, a free port, how a process ended. Imports nothing of llmadapt but errors."""

from __future__ import annotations

import os
from pathlib import Path

# datetime, random and socket are imported where used: every command imports this module, `llmadapt --help` too.

VERSION = "0.1.0"
"""This release of llmadapt (``llmadapt.__version__``)."""


def state_dir() -> Path:
    """The state folder (environments, checkpoints, caches): ``$LLMADAPT_HOME``, else ``$XDG_CACHE_HOME/llmadapt``, else
    ``~/.cache/llmadapt``."""
    if os.environ.get("LLMADAPT_HOME"):
        return Path(os.environ["LLMADAPT_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmadapt"


def utc_now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def software_versions(packages: tuple[str, ...]) -> dict[str, str]:
    """Python's and llmadapt's versions, and those of PACKAGES that are installed here (for a header)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version(), "llmadapt": VERSION}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def local_hostname_is_loopback() -> tuple[str, str] | None:
    """(hostname, address) when this host's name resolves to a loopback address, the multi-node trap."""
    import socket

    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return None
    return (name, addr) if addr.startswith("127.") or addr == "::1" else None


def node_name() -> str:
    """The node's name as the scheduler knows it (Slurm's node name where set), else the hostname."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def free_port() -> int:
    """A free TCP port for a process we start next (an engine, a rendezvous store).

    Not the kernel's ``bind(0)``: that port comes from the ephemeral range and, once released, is handed out
    again to the next ``bind(0)`` or outgoing connection, so another server could take it in the seconds
    before our engine binds it, and our health check would then be answered by a stranger. A random port
    below the ephemeral range is not reissued that way.
    """
    import random
    import socket

    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def gpu_visible() -> bool:
    """Whether workers will see a GPU (checked without torch): an NVIDIA device node or tool, not forced to CPU."""
    import shutil

    if os.environ.get("LLMADAPT_DEVICE", "auto") == "cpu" or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def exit_text(code: int) -> str:
    """How a process ended, from its exit status as ``subprocess`` gives it (negative: the signal that killed it):
    'was killed by SIGSEGV (signal 11)', 'exited with code 3' (after a subject: 'the engine ...'). The one wording
    of how a process ended in every failure record."""
    if code >= 0:
        return f"exited with code {code}"
    import signal

    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"was killed by signal {-code}"
    return f"was killed by {name} (signal {-code})"


def exit_cause(code: int) -> str:
    """The failure cause of a process that ended with ``code``: ``killed`` by a signal, else ``crash``."""
    return "killed" if code < 0 else "crash"
