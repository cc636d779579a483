"""Nodes as network namespaces: several "machines" on one host, each with its own network stack.

Why: what sets two nodes apart for the capture plane is not only their folders. Each node has its
own loopback, its own abstract Unix socket namespace (stock Kineto and dynolog meet at the
abstract `@dynolog`, one per node) and its own address; a job's ranks on two nodes talk over a
network, not over loopback. `NodeNetwork(k)` builds k such nodes on one L2 segment, the way a
cluster's nodes share a switch:

    switch netns:  bridge br0 (no address; its own, empty iptables: nothing filtered)
    node i netns:  lo, eth0 = 10.250.X.(10+i)/24, a veth whose other end is on br0
    this host:     gl<X> = 10.250.X.1/24 on br0 (the coordinator and tests reach the nodes here)

X is a free third octet chosen per network, so concurrent runs do not share a segment. Nothing
outside the namespaces changes except the one host-side veth, removed with the switch.
`close()` (or the context manager) deletes every namespace it made. Needs root.
"""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@dataclass(frozen=True)
class NetNode:
    netns: str
    ip: str              # its address on the segment: reachable from this host and the other nodes
    ifname: str = "eth0"

    def cmd(self, argv: list[str]) -> list[str]:
        """argv run inside this node's network namespace (same pid, same environment)."""
        return ["ip", "netns", "exec", self.netns, *argv]


class NodeNetwork:
    def __init__(self, count: int, *, prefix: str = "gl"):
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
        free = [x for x in range(16, 240) if f" 10.250.{x}." not in used]
        self.octet = random.choice(free)
        tag = f"{prefix}{os.getpid() % 100000}x{self.octet}"
        self.switch = f"{tag}-sw"
        self.host_if = f"gl{self.octet}"
        self.host_ip = f"10.250.{self.octet}.1"
        self.nodes: list[NetNode] = []
        self._made: list[str] = []
        try:
            self._build(count, tag)
        except Exception:
            self.close()
            raise

    def _build(self, count: int, tag: str) -> None:
        net = f"10.250.{self.octet}"
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", "host", "netns", self.switch)
        _ip("-n", self.switch, "link", "set", "host", "master", "br0", "up")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        for i in range(count):
            node = NetNode(netns=f"{tag}-n{i + 1}", ip=f"{net}.{10 + i + 1}")
            _ip("netns", "add", node.netns)
            self._made.append(node.netns)
            _ip("-n", node.netns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", f"n{i + 1}", "type", "veth", "peer", "name", node.ifname,
                "netns", node.netns)
            _ip("-n", self.switch, "link", "set", f"n{i + 1}", "master", "br0", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", node.ifname, "up")
            self.nodes.append(node)

    def close(self) -> None:
        for ns in reversed(self._made):          # the switch last: its veths take the host end along
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)

    def __enter__(self) -> "NodeNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
