"""``make test`` runs every test on the session's Ray cluster on one pytest-xdist worker
(``tests/conftest.py`` puts them in the ``ray`` group): the machine holds one test cluster, and tests that share files
(the recording policies of ``tests/sim/test_features_agree.py`` write under
``.pytest_cache``) never run at once. Two things silently undid that before: the grouping
hook ran after pytest-xdist had read the groups, and pytest 9.2 keeps node ids where
pytest-xdist 3.8 no longer adds the group (hence ``pytest<9.2`` in pyproject.toml); either
way the Ray tests spread over both workers and one deleted another's records mid-run.
This runs the project's hook under ``-n 2 --dist loadgroup`` and checks where tests land."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = "from tests.conftest import pytest_collection_modifyitems  # noqa: F401 (the project's hook)\n"
TESTS = """
import os
import pytest

@pytest.fixture
def ray_cluster():  # the name the project's hook looks for; no Ray started here
    return None

def record(tmp, name):
    (tmp / name).write_text(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.parametrize("i", range(4))
def test_ray(ray_cluster, i):
    record(pytest.RESULTS, f"ray-{i}")

@pytest.mark.parametrize("i", range(4))
def test_plain(i):
    record(pytest.RESULTS, f"plain-{i}")

@pytest.mark.ray
def test_own_ray(request):  # a Ray test with a Ray of its own: free to run on either worker
    record(pytest.RESULTS, "own")
    (pytest.RESULTS / "own.nodeid").write_text(request.node.nodeid)

def test_grouped_id(ray_cluster, request):
    (pytest.RESULTS / "grouped.nodeid").write_text(request.node.nodeid)
"""


def test_every_test_on_the_session_cluster_runs_on_one_worker(tmp_path):
    suite, results = tmp_path / "suite", tmp_path / "results"
    suite.mkdir()
    results.mkdir()
    (suite / "conftest.py").write_text(
        CONFTEST + f"import pytest\npytest.RESULTS = __import__('pathlib').Path({str(results)!r})\n"
    )
    (suite / "test_grouped.py").write_text(TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", str(suite)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ids = {p.stem: p.read_text() for p in results.glob("*.nodeid")}
    workers = {p.name: p.read_text() for p in results.iterdir() if p.suffix != ".nodeid"}
    assert len(workers) == 9, workers
    assert len({w for name, w in workers.items() if name.startswith("ray-")}) == 1, workers
    # pytest-xdist names a test's group in its id: the session cluster's tests are in "ray", a
    # Ray test without that fixture in none, so it balances onto whichever worker is free
    assert ids["grouped"].endswith("@ray") and "@" not in ids["own"], ids
