"""A stand-in for the Kubernetes API server's pod endpoints, for running the recipe on 127.0.0.1.

A stand-in for the Kubernetes control plane only: no kube-apiserver ships as a Debian or PyPI
package, so the recipe's test cannot run a real one here. It serves exactly what smg's service
discovery calls (kube-runtime's watcher: LIST of one namespace's pods by label selector, paged,
then WATCH from the list's resourceVersion), each pod as the kubelet would report it (Running,
its IP, its Ready condition; a deletionTimestamp once it is marked for deletion). It holds every
request to the recipe's own Role for the caller's ServiceAccount token: what the Role does not
allow is refused (403) and recorded, so the test shows that Role is enough, and not more.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import yaml

_PODS = re.compile(r"^/api/v1/namespaces/(?P<namespace>[^/]+)/pods(/(?P<name>[^/]+))?$")


class KubeAPI:
    """Pods of one namespace, their change events, and who asked for what."""

    def __init__(self, namespace: str, rules: list[dict]) -> None:
        self.namespace, self.rules, self.token = namespace, rules, secrets.token_hex(16)
        self.pods: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []  # (resourceVersion, type, pod)
        self.asked: list[str] = []  # every request: "verb path?query"
        self.refused: list[str] = []
        self._version = 1
        self._changed = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._stopping = False
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        """What the pod's mounted ServiceAccount token gives smg, as a kubeconfig (KUBECONFIG)."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "recipe",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "gateway", "user": {"token": self.token}}],
            "contexts": [{"name": "recipe", "context": {"cluster": "stand-in", "user": "gateway",
                                                          "namespace": self.namespace}}]}))
        return path

    def put(self, name: str, labels: dict, annotations: dict, spec: dict, ip: str, ready: bool) -> None:
        """Create or update a pod as the kubelet reports it (Running, with this IP and readiness)."""
        with self._changed:
            known = self.pods.get(name)
            meta = {"name": name, "namespace": self.namespace, "uid": known["metadata"]["uid"] if known else
                    str(uuid.uuid4()), "labels": labels, "annotations": annotations,
                    "creationTimestamp": _now()}
            status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
                      "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
            self._emit("MODIFIED" if known else "ADDED", {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                                                           "spec": spec, "status": status})

    def mark_deleted(self, name: str) -> None:
        """`kubectl delete pod`: the API server marks the pod (deletionTimestamp, its status as the
        kubelet last reported it); the kubelet then stops it (`stopped`)."""
        with self._changed:
            pod = json.loads(json.dumps(self.pods[name]))
            pod["metadata"]["deletionTimestamp"] = _now()
            self._emit("MODIFIED", pod)

    def stopped(self, name: str) -> None:
        """The kubelet reports the marked pod's containers stopped: no longer Ready."""
        with self._changed:
            pod = json.loads(json.dumps(self.pods[name]))
            pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
            self._emit("MODIFIED", pod)

    def remove(self, name: str) -> None:
        """The pod's containers have stopped: it is gone."""
        with self._changed:
            self._emit("DELETED", self.pods[name])

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def _emit(self, kind: str, pod: dict) -> None:
        self._version += 1
        pod = {**pod, "metadata": {**pod["metadata"], "resourceVersion": str(self._version)}}
        if kind == "DELETED":
            self.pods.pop(pod["metadata"]["name"])
        else:
            self.pods[pod["metadata"]["name"]] = pod
        self.events.append((self._version, kind, pod))
        self._changed.notify_all()

    def allows(self, verb: str, namespace: str, token: str) -> bool:
        """The recipe's Role, bound to the gateway's ServiceAccount, in its namespace."""
        return token == self.token and namespace == self.namespace and any(
            "" in r.get("apiGroups", []) and "pods" in r.get("resources", []) and verb in r.get("verbs", [])
            for r in self.rules)

    def selected(self, selector: str) -> list[dict]:
        return [p for p in self.pods.values() if _matches(selector, p["metadata"]["labels"])]

    def watch(self, since: int, selector: str, until: float, write) -> None:
        """Stream each event after `since` that the selector matches, until `until` (or stop)."""
        sent = since
        while True:
            with self._changed:
                while not self._stopping and time.monotonic() < until and self._version <= sent:
                    self._changed.wait(timeout=min(1.0, max(0.0, until - time.monotonic())))
                if self._stopping or time.monotonic() >= until:
                    return
                fresh = [e for e in self.events if e[0] > sent]
                sent = self._version
            for _, kind, pod in fresh:
                if _matches(selector, pod["metadata"]["labels"]):
                    write({"type": kind, "object": pod})


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _matches(selector: str, labels: dict) -> bool:
    """An equality-based label selector (`k=v,k2=v2`: what smg sends); empty selects every pod."""
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value.lstrip("="):
            return False
    return True


def _handler(api: KubeAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            found = _PODS.match(url.path)
            verb = "watch" if query.get("watch") in ("true", "1") else "get" if found and found["name"] else "list"
            api.asked.append(f"{verb} {self.path}")
            token = self.headers.get("authorization", "").removeprefix("Bearer ")
            if found is None or not api.allows(verb, found["namespace"], token):
                api.refused.append(f"{verb} {self.path}")
                return self._json(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                                        "reason": "Forbidden", "message": f"{verb} {url.path} is not allowed"})
            selector = query.get("labelSelector", "")
            if verb == "get":
                pod = api.pods.get(found["name"])
                return self._json(200, pod) if pod else self._json(404, {"kind": "Status", "code": 404})
            if verb == "list":
                with api._changed:
                    version, items = api._version, api.selected(selector)
                return self._json(200, {"kind": "PodList", "apiVersion": "v1",
                                        "metadata": {"resourceVersion": str(version)}, "items": items})
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()

            def write(event: dict) -> None:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            until = time.monotonic() + float(query.get("timeoutSeconds", 290))
            try:
                api.watch(int(query.get("resourceVersion") or 0), selector, until, write)
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client went away
                pass
            self.close_connection = True

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    return Handler
