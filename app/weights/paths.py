"""Which filesystem paths a network caller may make tito read (weights, LoRA adapters).

Every path from a request (``weight_dir``, ``lora_path``) goes through ``resolve_allowed``: symlinks are followed,
and the real path must lie inside one of the allowed roots, else 403.
"""

from __future__ import annotations

import os
from pathlib import Path

from app.core.protocol import ApiError
from app.core.settings import Settings


def allowed_roots(settings: Settings) -> list[Path] | None:
    """The allowed roots, or None for "any path" (only when explicitly asked with --allow-any-weight-path)."""
    if settings.allow_any_weight_path:
        return None
    if settings.allowed_weight_root:
        return [Path(os.path.realpath(r)) for r in settings.allowed_weight_root]
    # Default: the served model's parent directory (checkpoints usually sit beside it) and the working directory,
    # but never the filesystem root (a model at /model or a server started in / would otherwise open everything).
    defaults = [Path(os.path.realpath(settings.model)).parent, Path(os.path.realpath(os.getcwd()))]
    return [r for r in defaults if r.parent != r]


def resolve_allowed(settings: Settings, raw: str, param: str) -> Path:
    """Resolve ``raw`` (symlinks followed) and check it is inside an allowed root; 403 otherwise."""
    if not raw or "\x00" in raw:
        raise ApiError(400, f"{param} must be a non-empty path.", param=param)
    real = Path(os.path.realpath(raw))
    roots = allowed_roots(settings)
    if roots is not None and not any(real == r or real.is_relative_to(r) for r in roots):
        raise ApiError(403, f"{param} {raw!r} is outside the allowed weight roots "
                            f"(set --allowed-weight-root to allow it).", param=param)
    return real
