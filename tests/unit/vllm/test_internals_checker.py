"""`eldr.vllm.internals`, the static check of the vLLM internals the plugin relies on, on
a tiny fake vLLM source tree: it finds what is there (through re-exports, base classes,
`self.x = ...`, fields and properties) and reports what is not (a module, a class, a
method, a parameter, an attribute, a string), so that it can fail. The list itself is
checked against our own code: every line it cites names the internal. tests/vllm runs
it on the installed vLLM."""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest

from eldr.vllm.internals import INTERNALS, Internal, check, main, vllm_version

REPO = Path(__file__).resolve().parents[3]

FILES = {
    "__init__.py": "from .version import __version__\n",
    "version.py": "try:\n    from ._version import __version__\nexcept ImportError:\n    "
    "__version__ = 'dev'\n",
    "_version.py": "__version__ = version = '9.1.0'\n",
    "runner/__init__.py": "from vllm.runner.base import Runner as Runner\n",
    "runner/ghost.py": "class Ghost:\n    pass\n",
    "runner/mixin.py": """
        class Mixin:
            def __init__(self):
                object.__setattr__(self, "frozen", 1)
        """,
    "runner/base.py": """
        from typing import TYPE_CHECKING, NamedTuple
        from .mixin import Mixin
        if TYPE_CHECKING:
            from .ghost import Ghost

        class State(NamedTuple):
            input_batch: int

        class Base(Mixin):
            def __init__(self, config):
                self.config = config
                self.a, self.b = 1, 2

            def get_model(self):
                return None

        class Runner(Base):
            limit: int = 3

            def execute_model(self, scheduler_output, extra=None, *, dummy_run=False):
                self.state: State | None = None

            @property
            def device(self):
                return "cpu"

        METRIC = "vllm:requests"
        """,
}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name, text in FILES.items():
        path = tmp_path / "vllm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def attr(module: str, cls: str, member: str) -> Internal:
    return Internal("attribute", module, cls, member)


def method(cls: str, member: str, **kw: object) -> Internal:
    return Internal("method", "vllm.runner", cls, member, **kw)  # type: ignore[arg-type]


PRESENT = [
    Internal("module", "vllm.runner.base"),
    Internal("class", "vllm.runner", "Runner"),  # re-exported by the package
    Internal("name", "vllm._version", "__version__"),
    Internal("name", "vllm.runner.base", "METRIC"),
    method("Runner", "execute_model", leading=("scheduler_output",), params=("dummy_run",)),
    method("Runner", "execute_model", own=True),
    method("Runner", "get_model"),  # inherited
    attr("vllm.runner", "Runner", "config"),  # self.x = ... in a base
    attr("vllm.runner", "Runner", "b"),  # tuple target
    attr("vllm.runner", "Runner", "frozen"),  # object.__setattr__ in a base's base
    attr("vllm.runner", "Runner", "limit"),  # class-level annotation
    attr("vllm.runner", "Runner", "device"),  # property
    attr("vllm.runner", "Runner", "state"),  # annotated self.x
    attr("vllm.runner.base", "State", "input_batch"),  # NamedTuple field
    Internal("literal", "vllm.runner", "vllm:requests"),  # anywhere in the package
]

ABSENT = {
    "no module vllm.runner.gone": Internal("module", "vllm.runner.gone"),
    "class Gone not in vllm.runner": Internal("class", "vllm.runner", "Gone"),
    "class Ghost not in vllm.runner.base": Internal("class", "vllm.runner.base", "Ghost"),
    "function Runner not in vllm.runner": Internal("function", "vllm.runner", "Runner"),
    "no method load_model in Runner < Base < Mixin": method("Runner", "load_model"),
    "no method get_model in Runner itself": method("Runner", "get_model", own=True),
    "no parameter is_profile": method("Runner", "execute_model", params=("is_profile",)),
    "are not (batch)": method("Runner", "execute_model", leading=("batch",)),
    "no attribute input_batch in Runner": attr("vllm.runner", "Runner", "input_batch"),
    "appears in no module": Internal("literal", "vllm.runner.base", "vllm:gone"),
}


def test_what_the_tree_has_is_found_with_where(tree: Path) -> None:
    findings = check(tree, PRESENT)
    assert [(f.status, f.detail) for f in findings if f.status != "ok"] == []
    lines = textwrap.dedent(FILES["runner/base.py"]).splitlines()
    assert findings[1].detail == f"vllm/runner/base.py:{lines.index('class Runner(Base):') + 1}"
    assert findings[9].detail.startswith("vllm/runner/mixin.py:")


def test_what_the_tree_lacks_is_reported_missing(tree: Path) -> None:
    findings = check(tree, list(ABSENT.values()))
    for (expected, internal), finding in zip(ABSENT.items(), findings, strict=True):
        assert finding.status == "missing", internal
        assert expected in finding.detail, (expected, finding.detail)


def test_the_package_directory_or_one_holding_it(tree: Path) -> None:
    assert check(tree / "vllm", PRESENT[:2]) == check(tree, PRESENT[:2])
    assert vllm_version(tree) == "9.1.0"
    with pytest.raises(FileNotFoundError):
        check(tree / "runner", PRESENT)


def test_the_real_list_fails_on_a_tree_without_any_of_it(tree: Path) -> None:
    findings = check(tree)
    found = [f.internal.what for f in findings if f.status == "ok"]
    assert found == ["vllm._version.__version__"]
    assert all(f.internal.note for f in findings if f.status == "unchecked")


def test_the_cli_prints_a_table_or_json_and_fails_when_something_is_missing(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tree)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"vLLM 9.1.0 at {tree / 'vllm'}\n")
    assert "missing   vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model(" in out
    assert main([str(tree), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == "9.1.0"
    assert len(report["findings"]) == len(INTERNALS)
    assert {"status", "what", "detail", "why", "ours", "note"} <= set(report["findings"][0])


def _our_source(cited: str) -> str:
    """The source of what `cited` (`file:symbol`) names: a function, `Class.method` or
    module-level name of a Python file, or the lines of pyproject.toml holding the text."""
    name, _, symbol = cited.partition(":")
    base = (
        REPO if name.startswith("tests/") or name == "pyproject.toml" else REPO / "libs/eldr/vllm"
    )
    text = (base / name).read_text()
    if not name.endswith(".py"):
        found = [line for line in text.splitlines() if symbol in line]
        assert found, cited
        return "\n".join(found).replace("-", "_")
    tree = ast.parse(text)
    if symbol == "__doc__":
        return (ast.get_docstring(tree) or "").replace("-", "_")
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in symbol.split("."):
        node = next(
            (
                n
                for n in body
                if (
                    isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    and n.name == part
                )
                or (
                    isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == part for t in n.targets)
                )
                or (
                    isinstance(n, ast.AnnAssign)
                    and isinstance(n.target, ast.Name)
                    and n.target.id == part
                )
            ),
            None,
        )
        assert node is not None, f"{cited}: no {part}"
        body = getattr(node, "body", [])
    segment = ast.get_source_segment(text, node) if node is not None else None
    assert segment is not None, cited
    return segment.replace("-", "_")


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda i: i.what)
def test_every_line_the_list_cites_names_the_internal(internal: Internal) -> None:
    assert internal.ours
    assert internal.why
    names = {internal.member or internal.name or internal.module, *internal.params}
    if internal.member == "__init__":
        names.add(internal.name)
    if internal.kind == "unchecked":
        return
    for cited in internal.ours:
        assert any(n in _our_source(cited) for n in names), (cited, names)


def test_each_internal_is_listed_once() -> None:
    keys = [(i.kind, i.what) for i in INTERNALS]
    assert len(keys) == len(set(keys))


def test_a_runner_generation_a_release_does_not_ship_is_absent_not_missing(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.34 removed Model Runner V1: the plugin wraps the runners it finds, so the
    removed generation's internals are "absent" (exit 0); a member missing from a
    generation that is there still fails, and so does a release with no generation."""
    from eldr.vllm import internals

    monkeypatch.setattr(
        internals,
        "GENERATIONS",
        {"old runner": ("vllm.runner.old", "vllm.runner.old_batch"), "new": ("vllm.runner",)},
    )
    listed = [
        Internal("class", "vllm.runner.old", "OldRunner"),
        attr("vllm.runner.old_batch", "Batch", "req_ids"),
        attr("vllm.runner", "Runner", "input_batch"),  # the generation that is there lacks it
    ]
    assert [(f.status, f.detail[:14]) for f in check(tree, listed)] == [
        ("absent", "old runner is "),
        ("absent", "old runner is "),
        ("missing", "no attribute i"),
    ]
    monkeypatch.setattr(internals, "GENERATIONS", {"old runner": ("vllm.runner.old",)})
    assert [f.status for f in check(tree, listed[:1])] == ["missing"]
