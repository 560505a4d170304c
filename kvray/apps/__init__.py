"""Applications built on kvray's runtime and simulator: trace replay on Ray (``kvray
run``), the demo, ``kvray status``, policy evaluation (``kvray eval``) and the chat demo
on a real model. The library packages (core, cluster, sim, rl, engines) never import
from here."""
