"""README's layout section names every part of the package: each subpackage of kvray/, each
module at its top, and each module of kvray/core (the layer a user embeds)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layout_block() -> str:
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    return section.split("```", 2)[1]


def test_the_layout_names_every_package_and_top_level_module():
    block = layout_block()
    kvray = ROOT / "kvray"
    parts = [f"kvray/{p.name}/" for p in kvray.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    parts += [f"kvray/{p.name}" for p in kvray.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    missing = sorted(p for p in parts if p not in block)
    assert not missing, f"README's layout section does not name {missing}"


def test_the_layout_names_every_core_module():
    block = layout_block()
    core = [p.name for p in (ROOT / "kvray" / "core").glob("*.py") if p.name != "__init__.py"]
    missing = sorted(m for m in core if f"  {m}" not in block)
    assert not missing, f"README's layout section does not name kvray/core's {missing}"
