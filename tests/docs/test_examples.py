"""Documented examples run: every Python block of README.md (those using vLLM in the
vLLM environment, ``make vllm-env``) and the ``Example::`` block of every module docstring
in the parts of kvray that need neither Ray nor vLLM.

Module examples in :mod:`kvray.cluster`, :mod:`kvray.apps`, :mod:`kvray.bench` and the vLLM
adapter are excerpts of code that needs a running Ray cluster or a vLLM engine around it;
the runtime, replay and engine tests run that code.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from kvray.harness.vllm_env import vllm_python

ROOT = Path(__file__).resolve().parents[2]
NEEDS_RAY_OR_VLLM = ("kvray/cluster/", "kvray/apps/", "kvray/bench/", "kvray/engines/vllm")


def readme_blocks() -> list[str]:
    blocks = re.findall(r"^( *)```python\n(.*?)^ *```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    return [textwrap.dedent(code) for _, code in blocks]


def module_examples() -> dict[str, str]:
    examples = {}
    for path in sorted((ROOT / "kvray").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(NEEDS_RAY_OR_VLLM):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "Example::" in doc:
            examples[relative] = textwrap.dedent(doc.split("Example::", 1)[1])
    return examples


def run_example(code: str, where: Path, monkeypatch) -> None:
    if "from vllm" in code:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([str(vllm_python()), "-c", code], cwd=where, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        return
    monkeypatch.chdir(where)
    exec(compile(code, "<example>", "exec"), {"__name__": "__example__"})


def test_there_are_examples_to_run():
    assert len(readme_blocks()) >= 2
    assert len(module_examples()) >= 10


@pytest.mark.parametrize("block", range(len(readme_blocks())))
def test_readme_python_block_runs(block, tmp_path, monkeypatch):
    run_example(readme_blocks()[block], tmp_path, monkeypatch)


@pytest.mark.parametrize("module", sorted(module_examples()))
def test_module_docstring_example_runs(module, tmp_path, monkeypatch):
    run_example(module_examples()[module], tmp_path, monkeypatch)
