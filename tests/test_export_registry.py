"""The export formats are one registry (`autoprec.exports.FORMATS`): a new format is one
module whose ``export`` takes an `ExportRequest` and one entry there, and ``autoprec
export`` offers it, writes it and cleans up after its refusal without a line changed
elsewhere. Outside `autoprec.exports`, no code tells the formats apart by name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from autoprec.cli import _build_parser
from autoprec.errors import ExportError
from autoprec.exports import FORMATS, ExportFormat, ExportRequest, export_policy
from autoprec.exports.registry import load
from autoprec.policy import Policy, Rule

PACKAGE = Path(__file__).resolve().parents[1] / "autoprec"

WRITER = '''
from pathlib import Path

from autoprec.errors import ExportError


def export(request):
    """The policy's default dtype and its rules, one a line."""
    path = Path(request.out_dir) / "rules.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [request.policy.default, *(f"{r.describe()}: {r.dtype}" for r in request.policy.rules)]
    path.write_text("\\n".join(lines) + "\\n")
    if request.device == "refuse":
        raise ExportError("format 'rules': refused after writing")
    return [path]
'''


@pytest.fixture
def rules_format(tmp_path, monkeypatch):
    """A format written outside the package: its module, and its entry in the registry."""
    (tmp_path / "rules_format.py").write_text(WRITER)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = ExportFormat(
        "rules",
        "rules_format:export",
        "the policy's rules as text (rules.txt)",
        ("rules.txt",),
        model="unused",
        device="cpu",
    )
    monkeypatch.setitem(FORMATS, "rules", entry)
    return entry


def test_a_new_format_is_one_module_and_one_entry(rules_format, tmp_path):
    policy = Policy(rules=(Rule("fp32", patterns=("fc2",)),), default="bf16")
    written = export_policy(policy, "rules", tmp_path / "out")
    assert [p.name for p in written] == ["rules.txt"]
    assert written[0].read_text() == "bf16\npatterns fc2: fp32\n"

    # autoprec export offers it, with its help line
    parser = _build_parser()
    (commands,) = (a for a in parser._actions if a.dest == "command")
    (fmt,) = (a for a in commands.choices["export"]._actions if a.dest == "format")
    assert "rules" in fmt.choices and "rules: the policy's rules as text (rules.txt)" in fmt.help

    # refused after writing into a folder it made: nothing is left behind
    with pytest.raises(ExportError, match="refused after writing"):
        export_policy(policy, "rules", tmp_path / "refused", device="refuse")
    assert not (tmp_path / "refused").exists()


def test_every_writer_takes_one_request():
    for fmt in FORMATS.values():
        writer = load(fmt.writer)
        (parameter,) = inspect.signature(writer).parameters.values()
        assert parameter.annotation in ("ExportRequest", ExportRequest), fmt.name
        assert fmt.help and fmt.files, fmt.name


def test_an_unknown_format_is_refused_naming_them():
    with pytest.raises(ExportError, match=r"format 'onnx': unknown \(expected one of yaml, "):
        export_policy(Policy(default="bf16"), "onnx", "nowhere")


def _format_comparisons(tree: ast.AST) -> list[str]:
    """Comparisons of a format name with a value named as a format (``fmt == "cann"``,
    ``format in ("model", "torchao")``), and lists of format names kept as one
    (``SERVING_FORMATS = ("model", "torchao")``; a mode names its default by name)."""
    names = set(FORMATS)
    found = []
    for node in ast.walk(tree):
        listed = isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple | ast.List)
        if isinstance(node, ast.Compare) or listed:
            text = ast.unparse(node)
            named = any(isinstance(c, ast.Constant) and c.value in names for c in ast.walk(node))
            if named and ("fmt" in text or "format" in text.lower()):
                found.append(text)
    return found


def test_no_code_outside_the_exports_tells_formats_apart_by_name():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "exports" not in path.relative_to(PACKAGE).parts:
            hits = _format_comparisons(ast.parse(path.read_text()))
            if hits:
                found[str(path.relative_to(PACKAGE))] = hits
    assert found == {}
    # the scan finds what it looks for
    code = 'SERVING_FORMATS = ("model", "torchao")\nif fmt == "cann" or fmt in ("yaml",): pass'
    assert len(_format_comparisons(ast.parse(code))) == 3
