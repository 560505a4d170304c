"""TCP keepalive on page-server connections (issue 32, item 5).

An authenticated connection idles between requests for as long as its client lives. A
client whose host dies (powered off, cut off) sends no FIN and no RST, so without
keepalive the server would hold that connection, its thread and its descriptor until the
store restarts. Both ends now turn keepalive on (``RuntimeConfig.keepalive``; a runtime's
stores and clients are checked here too), and within a request every wait of the server
is bounded.

On loopback a killed process is no dead host: its kernel closes its sockets and the
server reads the FIN at once. So the dead host is made in a network namespace of its own
(``unshare -rn``: a user namespace gives the test root there): a client process
authenticates against two servers, then the namespace's loopback drops every packet
(``tc``'s blackhole qdisc) and the client is SIGKILLed (tests/cluster/dead_client_host.py). Its FIN never arrives and the
server's probes go unanswered, as with a host that died; the server with short keepalive
closes the connection within its bound, the one whose keepalive idles for hours still
holds it.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.keepalive import Keepalive
from kvray.cluster.protocol import Plan
from kvray.cluster.transfer import PageServer, PeerLinks
from kvray.cluster.wire import TOKEN_BYTES
from kvray.core.config import PageLayout, TierSizes
from tests.cluster.test_transfer import MAX_PAGES, PAGE, DictStore, eventually, page_of

ROOT = Path(__file__).resolve().parents[2]
SHORT = Keepalive(idle_s=1, interval_s=1, probes=2)  # a dead peer's connection closed within 3 s
SLACK_S = 10.0  # thread wake-ups on a loaded 2-core machine


def options(sock: socket.socket) -> tuple[int, int, int, int, int]:
    """The socket's keepalive settings (a store reads its own with the same calls)."""
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    )


def test_keepalive_is_on_at_both_ends_of_a_page_link():
    keepalive = Keepalive(idle_s=7, interval_s=3, probes=4)
    token = secrets.token_bytes(TOKEN_BYTES)
    store = DictStore(range(1, 4))
    server = PageServer(store.read, store.write, PAGE, token, "127.0.0.1", MAX_PAGES, keepalive=keepalive)
    links = PeerLinks(token, PAGE, timeout_s=10, keepalive=keepalive)
    try:
        rows = np.zeros((1, PAGE), dtype=np.uint8)
        assert links.load(server.address, [1]).receive(rows) == 1 and np.array_equal(rows[0], page_of(1))
        (accepted,) = server._conns  # the server's end of the one connection
        expected = (1, 7, 3, 4, (7 + 3 * 4) * 1000)  # unacknowledged bytes bounded alike, in ms
        assert options(accepted) == expected
        assert options(links._links[server.address].sock) == expected
    finally:
        links.close()
        server.close()


@pytest.mark.ray
def test_a_runtimes_keepalive_reaches_its_page_servers_and_clients(ray_cluster):
    """``RuntimeConfig.keepalive`` is what a store's page server and a client's links set."""
    keepalive = Keepalive(idle_s=11, interval_s=2, probes=5)
    config = RuntimeConfig(
        name="keepalive",
        layout=PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16"),
        tiers=TierSizes(host=8),
        keepalive=keepalive,
    )
    runtime = Runtime.start(config)
    client = KvrayClient.connect(config.name, buffer_pages=4)
    try:
        peer = next(n for n in runtime.stores if n != client.node_id)
        keys = client.keys_for_trace([1, 2])
        assert client.store(keys, 0, Plan.placing([peer, peer])) == 2  # by TCP: a link to the peer's page server
        expected = (1, 11, 2, 5, (11 + 2 * 5) * 1000)
        assert options(client.links._links[client.servers[peer]].sock) == expected

        def server_side(store) -> list[tuple[int, ...]]:
            import socket

            def read(sock):
                tcp = socket.IPPROTO_TCP
                names = (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT, socket.TCP_USER_TIMEOUT)
                return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE), *(sock.getsockopt(tcp, n) for n in names))

            return [read(conn) for conn in store._server._conns]

        assert ray.get(runtime.stores[peer].__ray_call__.remote(server_side), timeout=60) == [expected]
    finally:
        client.close()
        runtime.close()


def namespaces_available() -> bool:
    """Whether this machine lets an unprivileged user make a user + network namespace and
    drop its loopback traffic (``unshare``, ``ip`` and ``tc`` with the blackhole qdisc)."""
    if not all(shutil.which(tool) for tool in ("unshare", "ip", "tc")):
        return False
    probe = "ip link set lo up && tc qdisc add dev lo root blackhole"
    return subprocess.run(["unshare", "-rn", "sh", "-c", probe], capture_output=True).returncode == 0


@pytest.mark.fault
@pytest.mark.parametrize(
    "idle_s",
    [
        pytest.param(0.0, id="before-acknowledging-its-last-answer"),  # closed by TCP_USER_TIMEOUT
        pytest.param(0.5, id="idle"),  # everything acknowledged: closed by the keepalive probes
    ],
)
def test_a_connection_from_a_client_host_that_died_is_closed_within_the_keepalive_bound(idle_s):
    """The client host dies ``idle_s`` after its last request: at once (its delayed ACK of
    the answer never goes out, so the server holds unacknowledged bytes and probes never
    start: only ``TCP_USER_TIMEOUT`` can end it) or once idle (only the probes can). The
    short-keepalive server closes the connection within ``bound_s`` (+ slack) of the kill,
    and no sooner than ``idle_s`` after the last request: no FIN reached it
    (tests/cluster/dead_client_host.py). The server whose probes start hours later still holds its connection: without
    keepalive a dead host's connection stays."""
    if not namespaces_available():
        pytest.skip("needs a user + network namespace (unshare -rn) with tc's blackhole qdisc to make a dead host")
    done = subprocess.run(
        [
            *("unshare", "-rn", sys.executable, "-m", "tests.cluster.dead_client_host"),
            *(SHORT.model_dump_json(), str(SHORT.bound_s + SLACK_S), str(idle_s)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    fault = f"client host dies {idle_s:g} s after its last request, holding an authenticated page-server connection"
    print("RELIABILITY " + json.dumps({"fault": fault, **seen}))
    assert seen["held"] == {"short": 1, "hours": 1}
    assert seen["open"] == {"short": 0, "hours": 1}
    assert SHORT.idle_s <= seen["reaped_after_last_request_s"] and seen["reaped_after_kill_s"] <= SHORT.bound_s + SLACK_S


def test_a_server_hangs_up_on_a_client_that_stalls_mid_request():
    """Within a request every wait is bounded (``request_s``): a client that sends a request's
    head and then nothing loses its connection, and the server serves the next client."""
    token = secrets.token_bytes(TOKEN_BYTES)
    store = DictStore(range(1, 4))
    server = PageServer(store.read, store.write, PAGE, token, "127.0.0.1", MAX_PAGES, request_s=0.5)
    stalled, links = PeerLinks(token, PAGE, timeout_s=10), PeerLinks(token, PAGE, timeout_s=10)
    try:
        rows = np.zeros((3, PAGE), dtype=np.uint8)
        assert stalled.load(server.address, [1]).receive(rows) == 1
        stalled._links[server.address].sock.sendall(bytes([1]) + (3).to_bytes(4, "little"))  # LOAD of 3 keys, none sent
        assert eventually(lambda: server.connections == 0, timeout_s=SLACK_S)
        assert links.load(server.address, [1, 2, 3]).receive(rows) == 3
    finally:
        stalled.close()
        links.close()
        server.close()
