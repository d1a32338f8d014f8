"""A pushed chain over delayed links: each server behind a delay proxy of its own (benchmarks/
delay_proxy.py), announcing the proxy's address, so that every connection to it, the client's and
the other server's, is delayed. The tokens must be transformers' greedy tokens, and the pushed
hidden states must really have gone from server to server through a proxy (libp2p dials the
announced address, not the listening one), which the proxies' byte counts show."""

import signal
import time

import torch

from benchmarks.delay_proxy import ProxyRoute, ProxyThread, free_port

from .conftest import swarm_client

DELAY_S = 0.02
PROMPT = (torch.arange(512) % 250 + 4).unsqueeze(0)  # a prefill of 512 x 64 floats (128 KiB) pushed from A to B
NEW_TOKENS = 8


def _bytes_from_to(proxies: ProxyThread, ports: list[int], client_port: int) -> int:
    """Bytes from the server listening on ports[0] (A) to the one on ports[1] (B), through the proxy
    of either: into B's proxy on connections anyone but the client dialed (A, from its listening
    port, or from another if that one was taken; a little DHT traffic of others), and out of A's
    proxy on connections anyone but the client dialed (B's, if B dialed A)."""
    _, (proxy_of_a, proxy_of_b) = ports, proxies.proxies
    into_b = sum(n for port, n in proxy_of_b.counts.up.items() if port != client_port)
    out_of_a = sum(n for port, n in proxy_of_a.counts.down.items() if port != client_port)
    return into_b + out_of_a


def _listening_port(model) -> int:
    maddr = model.client.runtime.run(model.client.node.visible_maddrs())[0]  # /ip4/127.0.0.1/tcp/PORT/p2p/...
    return int(maddr.split("/tcp/")[1].split("/")[0])


def test_pushed_steps_cross_the_delayed_links(swarm, fresh_model, reference_model):
    listen_ports = [free_port(), free_port()]
    routes = [ProxyRoute(free_port(), port) for port in listen_ports]
    servers = []
    with ProxyThread(routes, DELAY_S) as proxies:
        try:
            for (start, end), route in zip([(0, 2), (2, 4)], routes):
                args = ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{route.target_port}",
                        "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{route.listen_port}"]
                servers.append(swarm.add_server(start, end, args, model=fresh_model, wait=False,
                                                name=f"{fresh_model.name}-delayed-{start}"))
            deadline = time.monotonic() + 120
            for server in servers:
                server.wait_online(deadline)
            with torch.inference_mode():
                expected = reference_model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
            with swarm_client(swarm, fresh_model, push=True, request_timeout_s=10.0) as model:
                client_port = _listening_port(model)  # its daemon dials out from there
                before = _bytes_from_to(proxies, listen_ports, client_port)
                with model.inference_session(PROMPT.shape[1] + NEW_TOKENS) as session, torch.inference_mode():
                    tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
                    assert session.push and len(session.route) == 2
                after = _bytes_from_to(proxies, listen_ports, client_port)
                counts = [(dict(proxy.counts.up), dict(proxy.counts.down)) for proxy in proxies.proxies]
        finally:
            for server in servers:  # all told first: they stop in parallel
                server.signal(signal.SIGTERM)
            for server in servers:
                server.stop()
    assert tokens == expected
    # the first server pushed the prompt's and every new token's hidden states (float32) to the second
    pushed = (PROMPT.shape[1] + NEW_TOKENS - 1) * reference_model.config.hidden_size * 4
    between_servers = after - before
    assert between_servers >= pushed, (
        f"only {between_servers} bytes went between the servers through the proxies, less than the {pushed} "
        f"pushed: the servers reached each other some other way (servers on {listen_ports}, the client on "
        f"{client_port}; bytes (up, down) by dialer port, per proxy: {counts})")
