"""Random prefix workloads for the policies' property tests: a request is a path in a small
tree of blocks, and an operation stores, hits, pins, unpins or drops its chain."""

from __future__ import annotations

from hypothesis import strategies as st

from kvray.core.manager import CacheManager

NO_MOVE = lambda *move: None  # noqa: E731  (a control-plane test: no bytes to move)

operations = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "hit", "pin", "unpin", "drop"]), st.lists(st.integers(0, 2), min_size=1, max_size=6)
    ),
    max_size=50,
)


def chain(path: list[int]) -> list[int]:
    """A request as a path in a small tree of blocks: its keys name their whole prefix."""
    return [hash(tuple(path[: i + 1])) & (2**62 - 1) for i in range(len(path))]


def apply(manager: CacheManager, op: str, path: list[int], pinned: list) -> None:
    """One operation of :data:`operations` on ``manager``; ``pinned`` holds the pins taken."""
    keys, index = chain(path), manager.index
    if op == "store":
        manager.store_chain(keys, NO_MOVE)
    elif op == "hit":
        manager.touch(manager.lookup(keys).handles)
    elif op == "pin" and len(manager.lookup(keys, count=False)):
        pinned.append(manager.lookup(keys, count=False).handles)
        manager.pin(pinned[-1])
    elif op == "unpin" and pinned:
        manager.unpin(pinned.pop())
    elif op == "drop" and index.handle_of(keys[-1]) is not None:
        manager.drop(index.handle_of(keys[-1]))
