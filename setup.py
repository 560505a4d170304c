"""Build steps: kvray's four C extensions, and kvray's shipped defaults in the wheel (see kvray/resources.py).

``kvray.core._tokens`` packs a Python list of token ids in C (kvray/core/_tokens.c; why:
kvray/core/keys.py); ``kvray.core._pagecopy`` copies a page and computes its xxh3-64 in
one pass (kvray/core/_pagecopy.c; why: kvray/core/pages.py); ``kvray.sim._chain`` is the
simulator's chain writer under LRU, eviction cascade and link bookings included
(kvray/sim/_chain.c; why: kvray/sim/node.py, ``SimNode.store_chain``); ``kvray.policy._pool``
gathers the learned policy's candidate pool in one pass and scores it, feature rows and
model included (kvray/policy/_pool.c; why: kvray/policy/reuse.py, ``ReusePolicy._pool_ranked``). ``pip install -e .``
(``make install``) builds them in place; a checkout used through ``PYTHONPATH`` builds them
with ``python setup.py build_ext --inplace``, and without them kvray converts lists, copies,
hashes and replays in Python, only slower.

``policies/``, ``simulations/`` and the demo data stay at the top of the repository, where
people edit them; a wheel gets copies under ``kvray/_bundled/`` so an installed kvray finds
its default policy, scenarios, demo trace and model configs without a checkout. Editable
installs read the checkout directly and copy nothing.
"""

import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

BUNDLED = ("policies", "simulations", "data/traces", "data/models")


class BuildWithDefaults(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for folder in BUNDLED:
            shutil.copytree(
                Path(folder),
                Path(self.build_lib) / "kvray" / "_bundled" / folder,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("tensorboard", "__pycache__"),
            )


setup(
    cmdclass={"build_py": BuildWithDefaults},
    ext_modules=[
        Extension("kvray.core._tokens", ["kvray/core/_tokens.c"], extra_compile_args=["-O2"]),
        Extension("kvray.core._pagecopy", ["kvray/core/_pagecopy.c"], extra_compile_args=["-O2"]),
        Extension(
            "kvray.sim._chain",
            ["kvray/sim/_chain.c"],
            depends=[
                "kvray/sim/_chain_state.h",
                "kvray/sim/_chain_links.h",
                "kvray/sim/_chain_reuse.h",
                "kvray/sim/_chain_s3fifo.h",
            ],
            extra_compile_args=["-O2"],
        ),
        Extension(
            "kvray.policy._pool",
            ["kvray/policy/_pool.c"],
            depends=["kvray/policy/_pool_forward.h"],
            extra_compile_args=["-O2", "-ffp-contract=off"],
        ),
    ],
)
