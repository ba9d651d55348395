"""Generated from ``vllm_control.proto`` / ``vllm_inference.proto`` (tito's copies of vLLM's native gRPC schema) by
``scripts/gen_protos.py``; do not edit the ``*_pb2*`` modules."""
