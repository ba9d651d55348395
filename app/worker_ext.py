"""Code that runs inside vLLM's worker processes, reached with ``engine.collective_rpc("<method>", ...)``.

vLLM mixes this class into its Worker (``AsyncEngineArgs(worker_extension_cls=...)``), so ``self`` is the worker:
``self.model_runner``, ``self.device`` etc. are available. It must stay importable in a freshly spawned process.
"""

from __future__ import annotations

import os


class TitoWorkerExtension:
    def liveness_probe(self) -> int:
        """A no-op round trip through every worker: proves the engine loop and workers answer."""
        return os.getpid()
