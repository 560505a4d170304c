"""Soak: many clients for minutes on local Ray nodes under random faults (``make soak``).

Not part of the test suite or CI: it runs for minutes (``make soak SOAK_MINUTES=1`` for a
short one). It starts ``nodes`` local Ray nodes (``ray.cluster_utils.Cluster``), a kvray
runtime, and ``clients`` client processes (Ray actors, spread over the nodes) that serve
requests on overlapping conversation prefixes for ``minutes``, checking every loaded page
against the bytes stored for its key (:class:`~kvray.cluster.checked.PagePattern`: the key
carries its whole prefix). Meanwhile the driver injects a random fault every
``fault_every_s`` seconds on average:

- ``store_kill``: a store process dies (``ray.kill``); Ray restarts it, at most
  ``STORE_RESTARTS`` times per store, so no store is killed more often than that;
- ``controller_kill``: the controller dies; Ray restarts it and it rebuilds its index;
- ``delayed_call``: a store's next copies between landing buffers and its tiers sleep past
  the clients' timeout (the store's ``inject_faults`` test hook), so clients give up on
  calls that still run;
- ``hostile_connection``: a connection to a page server that sends garbage (random bytes,
  a wrong token, a truncated request) and lingers a little.

The stores keep pages on disk only (no host tier), sized for every page the soak can
write, so no page is ever evicted and every page a store acknowledged (a ``store`` call
that stored all it was asked to) must still be held at the end, through every kill:
``acknowledged_pages_lost`` counts those that are not, and ``wrong_kv_at_rest`` the held
ones whose bytes are not their key's. The mapped host-tier path is not soaked here
(tests/cluster/test_mapped.py covers its faults).

Example::

    python -m kvray.apps.soak --minutes 1
    # SOAK {"requests_served": ..., "wrong_kv_served": 0, "acknowledged_pages_lost": 0, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from collections import Counter

import ray

from kvray.cluster.checked import PagePattern, serve_checked
from kvray.cluster.client import KvrayClient
from kvray.cluster.config import RuntimeConfig
from kvray.cluster.node_store import STORE_RESTARTS
from kvray.cluster.runtime import RayConnection, Runtime
from kvray.core.config import PageLayout, TierSizes

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")  # 128 KiB pages
CONVERSATIONS = 32
MAX_DEPTH = 8  # pages per request at most; CONVERSATIONS x MAX_DEPTH distinct pages in all
CLIENT_TIMEOUT_S = 5.0
DELAY_S = 2 * CLIENT_TIMEOUT_S
FAULTS = ("store_kill", "controller_kill", "delayed_call", "hostile_connection")


@ray.remote(num_cpus=0, max_restarts=0, scheduling_strategy="SPREAD")
class SoakClient:
    """One engine-like client: requests on overlapping prefixes, every loaded page checked."""

    def __init__(self, runtime_name: str, seed: int) -> None:
        self.client = KvrayClient.connect(runtime_name, buffer_pages=MAX_DEPTH, timeout_s=CLIENT_TIMEOUT_S)
        self.pattern = PagePattern(self.client.page_nbytes)
        self.rng = random.Random(seed)

    def ready(self) -> None:
        """Answers once the client has connected."""

    def run(self, seconds: float) -> dict:
        tally = Counter()
        errors: Counter = Counter()
        acknowledged: set[int] = set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conversation, depth = self.rng.randrange(CONVERSATIONS), self.rng.randint(1, MAX_DEPTH)
            keys = self.client.keys_for_trace([conversation * 100 + j for j in range(depth)])
            try:
                served = serve_checked(self.client, self.pattern, keys)
            except Exception as exc:  # noqa: BLE001 - a cache must never fail a request: count any that did
                errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
                tally["requests_failed"] += 1
                continue
            tally["requests_served"] += 1
            tally["pages_requested"] += len(keys)
            tally["pages_hit"] += served.hit
            tally["wrong_kv_served"] += served.wrong
            if served.stored and served.stored == len(keys) - served.hit:
                acknowledged.update(keys[served.hit :])
        tally.update({f"client_{kind}": n for kind, n in self.client.faults.items()})
        tally["buffers_renewed"] += self.client.renewed_buffers
        return {"tally": dict(tally), "errors": dict(errors), "acknowledged": sorted(acknowledged)}

    def close(self) -> None:
        self.client.close()


class Chaos:
    """The driver's fault injector: one random fault every ``every_s`` seconds on average."""

    def __init__(self, runtime: Runtime, every_s: float, seed: int) -> None:
        self.runtime = runtime
        self.every_s = every_s
        self.rng = random.Random(seed)
        self.kills: Counter = Counter()  # node -> store kills so far
        self.injected: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvray-soak-chaos", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.rng.expovariate(1 / self.every_s)):
            fault = self.rng.choice(FAULTS)
            try:
                done = getattr(self, fault)()
            except (ray.exceptions.RayError, OSError):
                done = False  # the target was down already (a kill in progress): nothing injected
            if done:
                self.injected[fault] += 1

    def store_kill(self) -> bool:
        nodes = [n for n in self.runtime.stores if self.kills[n] < STORE_RESTARTS]
        if not nodes:
            return False
        node = self.rng.choice(nodes)
        store = self.runtime.stores[node]
        ray.get(store.ping.remote(), timeout=10)  # up, not restarting: each kill costs exactly one restart
        ray.kill(store, no_restart=False)
        self.kills[node] += 1
        return True

    def controller_kill(self) -> bool:
        ray.kill(self.runtime.controller, no_restart=False)
        return True

    def delayed_call(self) -> bool:
        store = self.runtime.stores[self.rng.choice(list(self.runtime.stores))]
        store.inject_faults.remote(delay_s=DELAY_S, calls=self.rng.randint(1, 3))
        return True

    def hostile_connection(self) -> bool:
        servers = [s for s in ray.get(self.runtime.controller.members.remote(), timeout=10)["servers"].values() if s]
        if not servers:
            return False
        host, port = self.rng.choice(servers)
        garbage = [os.urandom(self.rng.randint(1, 4096)), b"\0" * 32 + os.urandom(64), os.urandom(32)[:-1]]
        threading.Thread(
            target=_hostile, args=((host, port), self.rng.choice(garbage), self.rng.uniform(0, 3)), daemon=True
        ).start()
        return True


def _hostile(address: tuple[str, int], payload: bytes, linger_s: float) -> None:
    """Connect, send ``payload``, linger, close; whatever the server does is its business."""
    try:
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(payload)
            time.sleep(linger_s)
    except OSError:
        pass  # refused or reset: the server is restarting, or hung up on us


def held_pages(runtime: Runtime, timeout_s: float = 120.0) -> dict[str, set[int]]:
    """Keys each store holds, once every store answers (a killed one may still be restarting)."""
    deadline = time.monotonic() + timeout_s
    held: dict[str, set[int]] = {}
    while len(held) < len(runtime.stores) and time.monotonic() < deadline:
        for node, store in runtime.stores.items():
            if node not in held:
                try:
                    held[node] = set(ray.get(store.info.remote(), timeout=10)["keys"])
                except (ray.exceptions.RayError, TimeoutError):
                    time.sleep(0.5)
    return held


def wrong_at_rest(runtime: Runtime, held: dict[str, set[int]], acknowledged: set[int], page_nbytes: int) -> int:
    """Acknowledged pages a store holds whose bytes are not their key's."""
    pattern, wrong = PagePattern(page_nbytes), 0
    for node, keys in held.items():
        for key in keys & acknowledged:
            pages = ray.get(runtime.stores[node].get_pages.remote([key]), timeout=60)
            wrong += sum(not pattern.matches(key, page) for page in pages)
    return wrong


def soak(minutes: float, clients: int, nodes: int, fault_every_s: float, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvray-soak-") as disk_root, RayConnection(nodes=nodes, object_store_mb=150):
        config = RuntimeConfig(
            name="soak",
            layout=LAYOUT,
            tiers=TierSizes(host=0, disk=2 * CONVERSATIONS * MAX_DEPTH),
            disk_root=disk_root,
            collective=False,
            local_pages_limit=4,
        )
        runtime = Runtime.start(config)
        try:
            actors = [SoakClient.remote(config.name, seed + i) for i in range(clients)]
            ray.get([a.ready.remote() for a in actors], timeout=600)  # connected before any fault
            chaos = Chaos(runtime, fault_every_s, seed)
            t0 = time.monotonic()
            runs = [a.run.remote(minutes * 60) for a in actors]
            chaos.start()
            try:
                results = ray.get(runs, timeout=minutes * 60 + 600)
            finally:
                chaos.stop()
            elapsed = time.monotonic() - t0
            ray.get([a.close.remote() for a in actors], timeout=60)
            acknowledged = set().union(*(set(r["acknowledged"]) for r in results))
            held = held_pages(runtime)
            lost = acknowledged - set().union(*held.values())
            figures = Counter()
            errors: Counter = Counter()
            for r in results:
                figures.update(r["tally"])
                errors.update(r["errors"])
            return {
                "minutes": round(elapsed / 60, 2),
                "clients": clients,
                "nodes": nodes,
                **{
                    k: figures[k]
                    for k in ("requests_served", "requests_failed", "pages_requested", "pages_hit", "wrong_kv_served")
                },
                "acknowledged_pages": len(acknowledged),
                "acknowledged_pages_lost": len(lost),
                "wrong_kv_at_rest": wrong_at_rest(runtime, held, acknowledged, LAYOUT.page_nbytes),
                "stores_unanswered_at_end": len(runtime.stores) - len(held),
                "faults_injected": dict(chaos.injected),
                "client_misses_by_cause": {k.removeprefix("client_"): v for k, v in figures.items() if k.startswith("client_")},
                "buffers_renewed": figures["buffers_renewed"],
                "errors": dict(errors.most_common(5)),
            }
        finally:
            runtime.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--fault-every-s", type=float, default=10.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    figures = soak(args.minutes, args.clients, args.nodes, args.fault_every_s, args.seed)
    print("SOAK " + json.dumps(figures))
    ok = not (
        figures["wrong_kv_served"]
        or figures["wrong_kv_at_rest"]
        or figures["acknowledged_pages_lost"]
        or figures["requests_failed"]
        or figures["stores_unanswered_at_end"]
    )
    print("soak: " + ("ok" if ok else "FAILED"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
