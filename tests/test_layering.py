"""`atlas` is the library; `pipelines/` holds job entrypoints that use it, never the reverse
(a worker or another project importing atlas must not need the entrypoints)."""

import ast
from pathlib import Path

ATLAS = Path(__file__).resolve().parents[1] / "atlas"


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                mods.add(node.args[0].value)
    return mods


def test_no_atlas_module_imports_pipelines():
    offenders = {
        str(p.relative_to(ATLAS.parent)): sorted(m for m in _imports(p) if m == "pipelines" or m.startswith("pipelines."))
        for p in sorted(ATLAS.rglob("*.py"))
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"atlas modules importing pipelines/: {offenders}"
