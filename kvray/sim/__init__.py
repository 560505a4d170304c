"""Simulation: the cost model, the trace-driven simulator around the real cache manager,
the gymnasium environment and training of placement policies (DESIGN.md, seam 2)."""
