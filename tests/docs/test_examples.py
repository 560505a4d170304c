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
from kvray.traces import cacheable_pages, read_trace

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


@pytest.mark.parametrize(
    "block", [pytest.param(i, marks=[pytest.mark.slow] if "from vllm" in code else []) for i, code in enumerate(readme_blocks())]
)
def test_readme_python_block_runs(block, tmp_path, monkeypatch):
    run_example(readme_blocks()[block], tmp_path, monkeypatch)


TRAINS = ("kvray/rl/train.py",)  # examples that train a policy: the train tier


@pytest.mark.parametrize(
    "module", [pytest.param(m, marks=[pytest.mark.train] if m in TRAINS else []) for m in sorted(module_examples())]
)
def test_module_docstring_example_runs(module, tmp_path, monkeypatch):
    run_example(module_examples()[module], tmp_path, monkeypatch)


def test_readme_runtime_kept_up_holds_the_replay_it_runs_twice():
    """README's "Keeping a runtime up" replays the same requests twice on a one-node runtime
    and says the second run finds the first one's pages: its ``kvray up`` must hold every
    distinct page of that replay, or LRU has evicted them by the time the second run asks."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("### Keeping a runtime up", 1)[1].split("### As a Ray job", 1)[0]
    host_pages = int(re.search(r"^kvray up .*--host-pages (\d+)", block, flags=re.M)[1])
    runs = re.findall(r"^kvray run .*--name kvray --trace (\S+) --limit (\d+)", block, flags=re.M)
    assert len(runs) == 2 and runs[0] == runs[1], runs
    trace, limit = runs[0]
    assert cacheable_pages(read_trace(ROOT / trace, limit=int(limit))) <= host_pages
