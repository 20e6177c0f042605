"""The installed vLLM has every internal the capture plugin relies on
(`eldr.vllm.internals`, read statically from its source), and the checker reads the same
tree this environment imports."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_support import SKIP_REASON

from eldr.vllm.internals import check, table, vllm_version

version = pytest.importorskip("vllm.version", reason=SKIP_REASON)
VLLM_ROOT = Path(version.__file__).parent


def test_the_installed_vllm_has_every_internal_the_plugin_reads() -> None:
    findings = check(VLLM_ROOT)
    missing = [f for f in findings if f.status == "missing"]
    assert not missing, "\n" + table(missing)
    assert {f.status for f in findings} == {"ok", "unchecked"}


def test_the_checker_reads_the_tree_this_environment_imports() -> None:
    assert vllm_version(VLLM_ROOT) == version.__version__
