"""A stand-in for KEDA's metrics server, for the cluster tests only.

KEDA's operator turns a ScaledObject into an HPA on an External metric and its metrics server
answers that metric through the aggregated API (``external.metrics.k8s.io/v1beta1``). KEDA
cannot be built on the test machine (its Go modules are out of reach), so this small adapter
serves the same API: each GET runs the query the chart renders into the ScaledObject's
postgresql trigger (``receipts.kedaQuery``: jobs due plus jobs in flight) on the test's
PostgreSQL and returns the count. The chart's external-metric HPA
(``autoscaling.hpa.metric=external``) then scales the Deployment as KEDA's would, with the
same target per pod. In production that HPA reads the PromQL recording rule of the chart's
PrometheusRule (``receipts.externalMetricRules``), which computes the same signal, and the
same adaptive-concurrency cap, from the workers' gauges; there is no Prometheus in the test
cluster, so the stand-in runs the SQL, whose cap ``tests/chart/test_chart_capacity.py``
checks on PostgreSQL (and the PromQL rule's with promtool).

It serves HTTPS (the aggregator insists) with a certificate the cluster script made; the
APIService skips verifying it (``insecureSkipTLSVerify``), as a test-only shortcut.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from datetime import UTC, datetime
from typing import Any

import psycopg
from aiohttp import web

GROUP_VERSION = "external.metrics.k8s.io/v1beta1"


class KedaMetricsStandIn:
    """Serve the External metrics API on ``host``:``port`` in a thread of its own.

    ``query`` is SQL returning one integer row (the chart's KEDA query); ``dsn`` where to run
    it. ``served`` counts the metric reads (the HPA controller's, every sync period).
    """

    def __init__(self, host: str, port: int, dsn: str, query: str, metric: str,
                 certfile: str, keyfile: str) -> None:
        self.host, self.port, self.dsn, self.query, self.metric = host, port, dsn, query, metric
        self.certfile, self.keyfile = certfile, keyfile
        self.served = 0
        self.last_value: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def _value(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(self.query).fetchone()
        return int(row[0]) if row else 0

    async def _resources(self, _: web.Request) -> web.Response:
        return web.json_response({
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION,
            "resources": [{"name": "externalmetrics", "singularName": "", "namespaced": True,
                           "kind": "ExternalMetricValueList", "verbs": ["get"]}]})

    async def _metric(self, request: web.Request) -> web.Response:
        name = request.match_info["metric"]
        if name != self.metric:
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                      "reason": "NotFound", "code": 404}, status=404)
        value = await asyncio.to_thread(self._value)
        self.served += 1
        self.last_value = value
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        item: dict[str, Any] = {"metricName": name, "metricLabels": {}, "timestamp": stamp,
                                "value": str(value)}
        return web.json_response({"kind": "ExternalMetricValueList", "apiVersion": GROUP_VERSION,
                                  "metadata": {}, "items": [item]})

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get(f"/apis/{GROUP_VERSION}", self._resources)
        app.router.add_get(f"/apis/{GROUP_VERSION}/namespaces/{{ns}}/{{metric}}", self._metric)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.certfile, self.keyfile)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, ssl_context=ctx).start()

    async def _close(self) -> None:
        # The API server keeps its TLS connections alive. The runner's cleanup closes them
        # gracefully: a TLS close waits for the client's close_notify, which may come after
        # the loop has stopped, leaving sockets for the garbage collector to warn about at
        # the end of the session (an error under filterwarnings=error). So stop listening,
        # let the runner close what it can, then abort whatever is still open.
        assert self._runner is not None
        for site in list(self._runner.sites):
            await site.stop()
        server = self._runner.server
        handlers = server.connections if server is not None else []
        transports = [h.transport for h in handlers if h.transport is not None]
        await self._runner.cleanup()
        for transport in transports:
            transport.abort()   # harmless on one already closed
        await asyncio.sleep(0)

    def start(self) -> KedaMetricsStandIn:
        """Start serving (returns once the socket listens)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def stop(self) -> None:
        """Stop serving, end the thread and close its event loop (and the executor that
        ran the queries): nothing is left for the garbage collector to warn about."""
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(30)
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(
                self._loop.shutdown_default_executor(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


def api_objects(host: str, port: int) -> str:
    """The Service, Endpoints and APIService that route ``external.metrics.k8s.io`` to the
    stand-in, and the RBAC that lets the HPA controller read it (KEDA's chart ships the same
    ClusterRole and binding)."""
    return f"""
apiVersion: v1
kind: Service
metadata: {{name: keda-standin, namespace: kube-system}}
spec: {{ports: [{{port: 443, targetPort: {port}}}]}}
---
apiVersion: v1
kind: Endpoints
metadata: {{name: keda-standin, namespace: kube-system}}
subsets: [{{addresses: [{{ip: "{host}"}}], ports: [{{port: {port}}}]}}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {{name: v1beta1.external.metrics.k8s.io}}
spec: {{group: external.metrics.k8s.io, version: v1beta1,
       service: {{name: keda-standin, namespace: kube-system, port: 443}},
       insecureSkipTLSVerify: true, groupPriorityMinimum: 100, versionPriority: 100}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: receipts-k8s-external-metrics-reader}}
rules: [{{apiGroups: [external.metrics.k8s.io], resources: ["*"], verbs: [get, list, watch]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: receipts-k8s-hpa-external-metrics}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole,
          name: receipts-k8s-external-metrics-reader}}
subjects: [{{kind: ServiceAccount, name: horizontal-pod-autoscaler, namespace: kube-system}}]
"""
