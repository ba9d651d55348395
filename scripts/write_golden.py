"""Write tests/golden/http_bytes.json, the generate route's pinned answers (tests/test_http_bytes.py), from the route
of the checkout it runs in. Only for an intended wire change: run it from the route that defines the new wire, and
say why in the commit. ``--check`` writes nothing and exits 1 when the file differs from what the route answers.

    python scripts/write_golden.py [--check]
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_http_bytes import CASES, GOLDEN, run_case  # noqa: E402


async def render() -> str:
    # The default path (no ``lean=`` argument), as the file was first written by a route without the lean path.
    out = {name: await run_case(variant, req) for name, variant, req in CASES}
    return json.dumps(out, indent=1, sort_keys=True) + "\n"


def main() -> int:
    text = asyncio.run(render())
    if "--check" in sys.argv:
        if not GOLDEN.is_file() or GOLDEN.read_text() != text:
            print(f"{GOLDEN} differs from the route's answers", file=sys.stderr)
            return 1
        return 0
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
