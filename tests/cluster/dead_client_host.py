"""A page-server client whose host dies, for tests/cluster/test_keepalive.py.

``python -m tests.cluster.dead_client_host KEEPALIVE_JSON WAIT_S IDLE_S``, run as root of
a fresh network namespace (``unshare -rn``): two page servers, one with the given
keepalive and one whose probes start hours later; a client process (``client`` mode) that
authenticates against both and then idles; IDLE_S later the namespace's loopback drops
every packet (``tc``'s blackhole qdisc) and the client is SIGKILLed, so its FIN never
arrives and probes go unanswered, as with a host that died. With IDLE_S 0 it dies before
its (delayed) acknowledgement of the last answer went out, so the servers hold
unacknowledged bytes; with IDLE_S 0.5 everything was acknowledged and only keepalive
probes can find it dead. Prints one JSON line: the connections each server
held before and holds after, and how long the short-keepalive one took to close its own
(waiting at most WAIT_S).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from kvray.cluster.keepalive import Keepalive
from kvray.cluster.transfer import PageServer, PeerLinks
from tests.cluster.test_transfer import MAX_PAGES, PAGE, DictStore

HOURS = Keepalive(idle_s=32767, interval_s=1, probes=1)  # on, but its first probe 9 hours away


def client(token: bytes, ports: list[int]) -> None:
    """Load a page from each server (so each connection is authenticated), then idle."""
    links = PeerLinks(token, PAGE, timeout_s=10)
    rows = np.zeros((1, PAGE), dtype=np.uint8)
    for port in ports:
        assert links.load(("127.0.0.1", port), [1]).receive(rows) == 1
    print("ready", flush=True)
    time.sleep(3600)


def host(short: Keepalive, wait_s: float, idle_s: float) -> dict:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    token = os.urandom(32)
    servers = {}
    for name, keepalive in (("short", short), ("hours", HOURS)):
        store = DictStore(range(1, 4))
        servers[name] = PageServer(store.read, store.write, PAGE, token, "127.0.0.1", MAX_PAGES, keepalive=keepalive)
    ports = [str(server.address[1]) for server in servers.values()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.cluster.dead_client_host", "client", token.hex(), *ports], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "ready\n"
    last_request = time.monotonic()
    held = {name: server.connections for name, server in servers.items()}
    time.sleep(idle_s)
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "blackhole"], check=True)  # the host goes silent
    proc.send_signal(signal.SIGKILL)  # and dies: its FIN is dropped
    proc.wait()
    killed = time.monotonic()
    while servers["short"].connections and time.monotonic() - killed < wait_s:
        time.sleep(0.05)
    reaped = time.monotonic()
    return {
        "held": held,
        "open": {name: server.connections for name, server in servers.items()},
        "reaped_after_kill_s": round(reaped - killed, 2),
        "reaped_after_last_request_s": round(reaped - last_request, 2),
    }


if __name__ == "__main__":
    if sys.argv[1] == "client":
        client(bytes.fromhex(sys.argv[2]), [int(port) for port in sys.argv[3:]])
    else:
        print(json.dumps(host(Keepalive.model_validate_json(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))))
