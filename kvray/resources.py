"""Where the files kvray ships beside its code are found: trained policies, scenarios,
demo traces and model configs.

In a checkout they are the top-level folders ``policies/``, ``simulations/`` and
``data/``, where people edit them (docs/design.md, "Layout"). A wheel carries copies of
them inside the package, under ``kvray/_bundled/`` (``setup.py`` copies them in at build
time), so an installed kvray finds its defaults without a checkout. The bundled copy wins
when both exist: an installed kvray must not pick up whatever folder happens to sit next
to ``site-packages``.

Example::

    from kvray.resources import bundled

    bundled("policies/default")            # the shipped RL policy's folder
    bundled("data/traces/synthetic_trace.jsonl")
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from kvray.core.errors import ConfigError

CHECKOUT = Path(__file__).resolve().parents[1]


def bundled(relative: str) -> Path:
    """The path of a shipped file or folder, from the wheel's copy or the checkout."""
    inside = Path(str(files("kvray"))) / "_bundled" / relative
    for candidate in (inside, CHECKOUT / relative):
        if candidate.exists():
            return candidate
    raise ConfigError(
        f"kvray's bundled {relative!r} is missing: looked in {inside} (an installed wheel) and "
        f"{CHECKOUT / relative} (a checkout); reinstall kvray from a wheel built by its setup.py, "
        "or run from a checkout of the repository"
    )


def shipped_or_given(path: str | Path, folder: str, suffix: str = "") -> Path:
    """``path`` if it exists, else the file or folder kvray ships by that name in ``folder``.

    So ``--scenario h100-llama8b-cluster`` and ``--trace synthetic_trace.jsonl`` work from
    any directory, installed or not, while a user's own file always wins.
    """
    given = Path(path)
    if given.exists():
        return given
    name = given.name if given.suffix or not suffix else given.name + suffix
    try:
        return bundled(f"{folder}/{name}")
    except ConfigError:
        raise ConfigError(f"{path}: no such file, and kvray ships no {folder}/{name}") from None
