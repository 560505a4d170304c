"""Simulation: the cost model and the trace-driven simulator that runs kvray's own cache
manager, index, slot accounting and placement policies with modeled instead of real byte
movement (docs/design.md, "One policy, two worlds")."""
