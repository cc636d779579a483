"""Cluster DNS feeder: keeps a dnsmasq hosts file in step with the API's Services.

Stands in for CoreDNS's `kubernetes` plugin (no CoreDNS package exists here): for every Service it
writes `<clusterIP> <svc>.<ns>.svc.<domain>`, and for headless Services one line per ready
endpoint address. dnsmasq (`--hostsdir`) re-reads the file on inotify, so a Service is resolvable
from pods about a second after it has endpoints. It watches Endpoints (every Service change moves
its Endpoints object too) and re-lists on each event or when the watch ends; stdlib only, so it
runs before any venv exists. No SRV records, no pod A records: the chart does not use them.
"""
from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Api:
    server: str
    ctx: ssl.SSLContext

    def get(self, path: str, timeout: float = 10.0):
        return urllib.request.urlopen(self.server + path, context=self.ctx, timeout=timeout)

    def json(self, path: str) -> dict:
        with self.get(path) as r:
            return json.load(r)


def hosts_lines(services: dict, endpoints: dict, domain: str) -> list[str]:
    """The hosts-file lines for a Service list and an Endpoints list (pure: tested offline)."""
    eps = {(e["metadata"]["namespace"], e["metadata"]["name"]): e for e in endpoints.get("items", [])}
    lines = []
    for svc in services.get("items", []):
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        fqdn = f"{name}.{ns}.svc.{domain}"
        ip = svc.get("spec", {}).get("clusterIP") or ""
        if ip and ip != "None":
            lines.append(f"{ip} {fqdn}")
            continue
        for subset in eps.get((ns, name), {}).get("subsets") or []:
            for addr in subset.get("addresses") or []:
                lines.append(f"{addr['ip']} {fqdn}")
    return sorted(set(lines))


def write_atomic(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.parent.with_name(f"{path.parent.name}.{path.name}.tmp")   # outside the dir dnsmasq watches
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def sync(api: Api, out: Path, domain: str) -> str:
    services = api.json("/api/v1/services")
    endpoints = api.json("/api/v1/endpoints")
    lines = hosts_lines(services, endpoints, domain)
    if write_atomic(out, "".join(line + "\n" for line in lines)):
        print(json.dumps({"event": "dns.synced", "records": len(lines)}), flush=True)
    return endpoints["metadata"]["resourceVersion"]


def run(api: Api, out: Path, domain: str) -> None:
    while True:
        try:
            rv = sync(api, out, domain)
            q = urllib.parse.urlencode({"watch": "1", "resourceVersion": rv, "timeoutSeconds": "60"})
            with api.get("/api/v1/endpoints?" + q, timeout=90) as stream:
                for _ in stream:      # one JSON event per line: any event means re-list
                    sync(api, out, domain)
        except Exception as e:  # noqa: BLE001 - the feeder must outlive apiserver restarts
            print(json.dumps({"event": "dns.error", "error": repr(e)}), flush=True)
            time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", required=True)
    ap.add_argument("--ca", required=True)
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--domain", default="cluster.local")
    a = ap.parse_args()
    ctx = ssl.create_default_context(cafile=a.ca)
    ctx.load_cert_chain(a.cert, a.key)
    run(Api(a.server.rstrip("/"), ctx), a.out, a.domain)


if __name__ == "__main__":
    sys.exit(main())
