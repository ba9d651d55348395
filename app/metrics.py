"""tito's own Prometheus families (the engine's ``vllm:*`` families live on the same default registry).

Defined once here so every router records into the same objects.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Info

INFLIGHT = Gauge("tito_inflight_requests", "Generate requests in flight")
REQUESTS = Counter("tito_requests_total", "HTTP requests by route and status", ["route", "status"])
REJECTED = Counter("tito_rejected_requests_total", "Requests refused with a 4xx before reaching the engine",
                   ["reason"])
DRAINING = Gauge("tito_draining", "1 while the server is draining")
PAUSED = Gauge("tito_paused", "1 while generation is paused")
WEIGHT_UPDATES = Counter("tito_weight_updates_total", "Weight updates by source and outcome", ["source", "outcome"])
WEIGHT_UPDATE_SECONDS = Histogram("tito_weight_update_seconds", "Seconds per successful weight update", ["source"],
                                  buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
WEIGHT_VERSION = Info("tito_weight_version", "Current weight version label")
LORA_LOADS = Counter("tito_lora_loads_total", "LoRA adapter loads by kind and outcome", ["kind", "outcome"])
LORA_LOAD_SECONDS = Histogram("tito_lora_load_seconds", "Seconds per successful LoRA adapter load",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
