"""Fast tests (no engine): settings precedence, CLI flags, the docs' flag table, safe unpickling, path checks."""

from __future__ import annotations

import os
import pickle

import pytest

from app.core.protocol import ApiError
from app.core.settings import FLAGS, Settings, flags_markdown
from app.engine.safe_pickle import UnsafePickleError, restricted_loads
from app.engine.vllm_args import parse_serve, vllm_defaults
from app.weights.paths import resolve_allowed
from tests.helpers import ROOT

FLAGS_PAGE = ROOT / "docs" / "reference" / "flags.md"


def test_flag_env_default_precedence():
    assert Settings.build(env={}).port == 8000
    assert Settings.build(env={"TITO_PORT": "9001"}).port == 9001
    assert Settings.build(env={"TITO_PORT": "9001"}, port=9002).port == 9002
    assert Settings.build(env={"TITO_ENABLE_LORA": "true"}).enable_lora is True
    s = parse_serve(["--port", "7000", "--enable-lora"], env={"TITO_PORT": "1"})
    assert s.port == 7000 and s.enable_lora is True


def test_bad_env_value_is_a_clear_error():
    with pytest.raises(SystemExit, match="TITO_PORT"):
        Settings.build(env={"TITO_PORT": "eighty"})


def test_every_flag_is_a_settings_field_and_documented():
    fields = set(Settings.__dataclass_fields__)
    page = FLAGS_PAGE.read_text()
    for f in FLAGS:
        assert f.name in fields, f.name
        assert f.cli in page and f.env in page, f.cli
    # The table is the generator's output for today's Settings (the other generated pages: tests/test_docs.py).
    theirs = vllm_defaults()
    table = flags_markdown({f.name: theirs[f.name] for f in FLAGS if f.name in theirs})
    assert table in page, "docs/reference/flags.md is stale: run python scripts/gen_reference.py"


def test_restricted_unpickler_admits_metadata_and_refuses_code(tmp_path):
    import torch

    meta = {torch.bfloat16: [("model.embed_tokens.weight", torch.Size([512, 128]), 65536)],
            torch.float32: [("model.norm.weight", torch.Size([128]), 128)]}
    assert restricted_loads(pickle.dumps(meta)) == meta

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(UnsafePickleError, match="posix.system|os.system"):
        restricted_loads(pickle.dumps(Evil()))
    assert not marker.exists()


def test_paths_outside_roots_are_refused(tmp_path):
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    s = Settings.build(env={}, allowed_weight_root=[str(root)])
    assert resolve_allowed(s, str(root / "ok"), "weight_dir") == (root / "ok").resolve()
    for bad in (str(root / ".." / "outside"), str(tmp_path / "outside"), str(root / "link"), "/etc"):
        with pytest.raises(ApiError) as e:
            resolve_allowed(s, bad, "weight_dir")
        assert e.value.status == 403
    anyp = Settings.build(env={}, allow_any_weight_path=True)
    assert str(resolve_allowed(anyp, "/etc", "weight_dir")) == os.path.realpath("/etc")


def test_defaults_agree_between_cli_env_docs_and_settings():
    """One declaration: the CLI with no flags, an empty environment and the docs' flag table all give Settings()'s
    defaults, and every default survives the trip through its own env variable."""
    import dataclasses
    import re

    base = Settings()
    assert parse_serve([], env={}) == base
    assert Settings.build(env={}) == base
    page = FLAGS_PAGE.read_text()
    row = re.compile(r"^\| `(--[\w-]+)` \| `TITO_\w+` \| `([^`]*)` \|", re.M)
    table = {m.group(1): m.group(2) for m in row.finditer(page)}
    assert set(table) == {f.cli for f in FLAGS}
    for f in FLAGS:
        assert f.default == getattr(base, f.name), f.name
        assert table[f.cli] == str(getattr(base, f.name)), f.cli
        if f.default is not None and not f.repeatable:
            assert getattr(Settings.build(env={f.env: str(f.default)}), f.name) == f.default, f.env
    # Every field but `vllm_args` is a flag.
    assert {f.name for f in dataclasses.fields(Settings)} - {f.name for f in FLAGS} == {"vllm_args"}
    assert "secret" not in repr(Settings(api_key="secret", admin_api_key="secret"))
