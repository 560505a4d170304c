"""Build step that puts kvray's shipped defaults into the wheel (see kvray/resources.py).

``policies/``, ``simulations/`` and the demo data stay at the top of the repository, where
people edit them; a wheel gets copies under ``kvray/_bundled/`` so an installed kvray finds
its default policy, scenarios, demo trace and model configs without a checkout. Editable
installs read the checkout directly and copy nothing.
"""

import shutil
from pathlib import Path

from setuptools import setup
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


setup(cmdclass={"build_py": BuildWithDefaults})
