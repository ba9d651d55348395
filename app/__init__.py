"""tito: a token-in/token-out inference server for RL rollouts, on a real vLLM engine."""

__version__ = "0.1.0"
