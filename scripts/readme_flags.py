"""Rewrite README's flag table from app/core/settings.py (``--check`` exits 1 if README is stale)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.core.settings import flags_markdown  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"
PATTERN = re.compile(r"(<!-- flags:start -->\n).*?(<!-- flags:end -->)", re.S)


def render(text: str) -> str:
    return PATTERN.sub(lambda m: m.group(1) + flags_markdown() + "\n" + m.group(2), text)


def main() -> int:
    text = README.read_text()
    new = render(text)
    if "--check" in sys.argv:
        if new != text:
            print("README flag table is stale: run python scripts/readme_flags.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
