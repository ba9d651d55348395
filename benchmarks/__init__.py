"""tito's benchmarks: one package, one entry point (``python -m benchmarks NAME [ARGS]``, from the repository root;
``python -m benchmarks`` lists them). Each benchmark is a module with a ``parser()`` and a ``main(argv)``; what they
share lives beside them:

- ``servers``: the servers' commands (tito, tito from another checkout, vLLM's own server), starting them in this
  session, free ports, worker processes;
- ``clients``: the closed-loop load generator (a worker process of its own), streaming clients, vLLM's own benchmark
  client;
- ``probes``: memory and CPU of a server's processes, file read speed, py-spy;
- ``report``: spreads (min / median / max), percentiles, the JSON a run leaves.

Results go to a new dated page under docs/benchmarks/, with the command that produced them.
"""
