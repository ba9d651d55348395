"""The Prime-RL guide (docs/guides/prime-rl.md) is Prime-RL's: its TOML parses with Prime-RL's own config classes (from
the source snapshot the tests use, ``tests/prime_rl_src.py``), its start command serves the name Prime-RL's model
check looks for (the check itself runs against a real tito in tests/test_prime_rl_writer.py)."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from tests.prime_rl_src import use_prime_rl

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "prime-rl.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", GUIDE.read_text(), re.S)


def test_the_guides_toml_is_prime_rls() -> None:
    use_prime_rl()
    from prime_rl.configs.shared import BaseModelConfig, ClientConfig

    (toml,) = blocks("toml")
    data = tomllib.loads(toml)
    client = ClientConfig(**data["orchestrator"]["model"]["client"])  # unknown keys are refused
    model = BaseModelConfig(**data["model"])
    assert client.base_url.endswith("/v1") and client.admin_base_url and client.api_key_var == "VLLM_API_KEY"
    # The start command serves that name (Prime-RL's model check: /v1/models must list model.name).
    (bash,) = [b for b in blocks("bash") if "tito serve" in b]
    argv = shlex.split(bash.replace("\\\n", " ").split("tito serve", 1)[1].split("\n")[0])
    assert argv[argv.index("--served-model-name") + 1] == model.name


def test_the_guide_marks_what_the_snapshots_prime_rl_lacks() -> None:
    """Settings the snapshot's Prime-RL does not have are marked as later or unreleased work, with a link."""
    use_prime_rl()
    import prime_rl.configs
    from prime_rl.configs.shared import ClientConfig

    configs = Path(next(iter(prime_rl.configs.__path__)))
    assert "update_protocol" not in "".join(p.read_text() for p in configs.rglob("*.py"))
    assert "dynamo" not in ClientConfig.model_fields
    text = GUIDE.read_text()
    for setting, mark in (("update_protocol", "**unreleased**"), ("client.dynamo", "**after 2026-08-21**")):
        row = next(line for line in text.splitlines() if setting in line and line.startswith("|"))
        assert mark in row and "https://github.com/PrimeIntellect-ai/prime-rl/" in row, row
