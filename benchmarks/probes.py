"""What the benchmarks watch on a server while they drive it: the memory of its process tree, the CPU time of its
processes (and threads), the read speed of a checkpoint's files, and py-spy samples.

CPU time from /proc moves far less than throughput when other work shares the machine: it is the figure a change's
cost per request is read from.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# --------------------------------------------------------------------------------------------------- CPU


def _stat_cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads; not its children); this process's when ``pid`` is
    None."""
    if pid is None:
        return time.process_time()
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of some processes (all their threads); a process that is gone counts 0."""
    total = 0.0
    for pid in pids:
        try:
            total += _stat_cpu(Path(f"/proc/{pid}/stat"))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (a server's EngineCore and its workers), from /proc."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and of every process below it (a server's API and engine processes)."""
    return cpu_seconds([pid, *descendants(pid)])


def engine_pid(pid: int) -> int:
    """The process below ``pid`` that runs the model (the EngineCore, which holds the worker on CPU): the busiest."""
    kids = descendants(pid)
    return max(kids, key=lambda k: cpu_seconds([k])) if kids else pid


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads, summed by thread name (``tokio-runtime-w``, ``MainThread``...): py-spy
    samples only threads that run Python, and some servers work mostly on Rust threads."""
    out: dict[str, float] = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (t / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + _stat_cpu(t / "stat")
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


# --------------------------------------------------------------------------------------------------- memory


def proc_mem(pid: int) -> tuple[int, int]:
    """(RSS, anonymous RSS) in bytes of ``pid`` and its descendants, from /proc (cheap enough for 10 Hz). The
    anonymous part is what the processes copy, not the page cache of a memory-mapped checkpoint."""
    rss = anon = 0
    for p in (pid, *descendants(pid)):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("RssAnon:"):
                    anon += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, anon


class Sampler:
    """A server tree's memory every ``every`` seconds in a thread: ``samples`` of ``(t, rss, anon)``."""

    def __init__(self, pid: int, every: float = 0.1) -> None:
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.monotonic(), *proc_mem(self.pid)))
            self.stop.wait(self.every)

    def steady(self, t0: float) -> tuple[float, float]:
        """Median (RSS, anon) of the 2 s before ``t0``."""
        xs = [s for s in self.samples if t0 - 2.0 <= s[0] < t0] or self.samples[-1:]
        return statistics.median(s[1] for s in xs), statistics.median(s[2] for s in xs)

    def peak(self, t0: float, t1: float) -> tuple[int, int]:
        """Largest (RSS, anon) between ``t0`` and ``t1``."""
        xs = [s for s in self.samples if t0 <= s[0] <= t1] or self.samples[-1:]
        return max(s[1] for s in xs), max(s[2] for s in xs)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


class RssSampler:
    """The peak resident memory of a process and, apart, of its descendants (the engine), every 0.5 s; its USS (the
    memory only it holds: its own share) once at the end."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_main = self.peak_main_uss = self.peak_children = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        # USS walks /proc/<pid>/smaps (~12 ms of kernel time, under the process's memory-map lock): not inside the
        # window being measured.
        import psutil

        try:
            self.peak_main_uss = max(self.peak_main_uss, psutil.Process(self.pid).memory_full_info().uss)
        except psutil.Error:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            main = _rss(self.pid)
            if main:
                self.peak_main = max(self.peak_main, main)
                self.peak_children = max(self.peak_children, sum(_rss(k) for k in descendants(self.pid)))
            self._stop.wait(0.5)

    def result(self) -> dict[str, float]:
        return {"server_rss_mb": self.peak_main / 2**20, "server_uss_mb": self.peak_main_uss / 2**20,
                "engine_rss_mb": self.peak_children / 2**20}


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------------------------------- files


def read_speed(files: list[Path]) -> dict[str, float]:
    """GB/s reading every byte of ``files`` with ``os.read`` in 64 MiB blocks: cold (each file ``fsync``ed and
    dropped from the page cache first) and warm (right after)."""
    size = sum(f.stat().st_size for f in files)
    out = {}
    for kind in ("cold", "warm"):
        t0 = time.perf_counter()
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                if kind == "cold":
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    t0 = time.perf_counter() if f == files[0] else t0
                while os.read(fd, 64 << 20):
                    pass
            finally:
                os.close(fd)
        out[f"{kind}_gbps"] = size / (time.perf_counter() - t0) / 1e9
    return out


# --------------------------------------------------------------------------------------------------- py-spy


def py_spy() -> str:
    """py-spy: ``$PY_SPY``, else on PATH, else beside this interpreter (``pip install py-spy``)."""
    return os.environ.get("PY_SPY") or shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


class Spy:
    """py-spy sampling one process to a collapsed-stack file (``--format raw``) while the ``with`` block runs."""

    def __init__(self, pid: int, out: Path, rate: int = 100, native: bool = False) -> None:
        self.pid, self.out, self.rate, self.native = pid, out, rate, native
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Spy:
        self.proc = subprocess.Popen([py_spy(), "record", "-p", str(self.pid), "-r", str(self.rate), "--format", "raw",
                                      "-o", str(self.out), *(["--native"] if self.native else ["--nonblocking"])],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached before the block's work starts
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def collapsed(stacks: Path) -> list[tuple[str, int]]:
    """The (stack, samples) lines of a py-spy raw file; none if py-spy wrote nothing."""
    if not stacks.exists():
        return []
    out = []
    for line in stacks.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit():
            out.append((stack, int(n)))
    return out
