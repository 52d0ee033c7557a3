"""The real OTLP/HTTP exporter against a small receiver, and against nothing at all."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class _Receiver(BaseHTTPRequestHandler):
    requests: list[tuple[str, str, bytes]]

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append((self.path, self.headers.get("Content-Type"), body))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_spans_reach_an_otlp_http_receiver(receiver, run_scenario):
    port = receiver.server_address[1]
    out = run_scenario("otlp", {"endpoint": f"http://127.0.0.1:{port}"})
    assert out["shutdown_ok"]
    traces = [r for r in receiver.requests if r[0] == "/v1/traces"]
    assert traces and all(ct == "application/x-protobuf" for _, ct, _ in traces)
    spans, resources = {}, []
    for _, _, body in traces:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            resources.append({kv.key: kv.value for kv in rs.resource.attributes})
            for ss in rs.scope_spans:
                assert ss.scope.name == "sft_runtime"
                for s in ss.spans:
                    spans[s.name] = s
    assert set(spans) == {"parent", "child"}
    parent, child = spans["parent"], spans["child"]
    assert parent.span_id.hex() == out["parent"][1] and parent.trace_id.hex() == out["parent"][0]
    assert child.parent_span_id == parent.span_id and child.trace_id == parent.trace_id
    assert parent.parent_span_id == b""
    attrs = {kv.key: kv.value for kv in parent.attributes}
    assert attrs["step"].int_value == 7 and attrs["note"].string_value == "hello"
    assert {kv.key: kv.value for kv in child.attributes}["valid_tokens"].int_value == 123
    res = resources[0]
    assert res["service.name"].string_value == "sft-runtime.worker"
    assert res["service.namespace"].string_value == "sft-runtime"
    assert res["sft.role"].string_value == "worker"
    assert res["sft.rank"].int_value == 3 and res["sft.attempt"].int_value == 2
    assert "host.name" in res and "process.pid" in res


@pytest.fixture(params=["nothing_listening", "never_answers"])
def dead_collector(request) -> Iterator[tuple[str, int]]:
    """A port held for the whole test, so no other process can start listening there:
    bound but never listening (connections are refused), or listening but never answering
    (the kernel's backlog accepts them)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    if request.param == "never_answers":
        s.listen(16)
    try:
        yield request.param, s.getsockname()[1]
    finally:
        s.close()


def test_shutdown_is_bounded_when_the_collector_is_down(dead_collector, run_scenario):
    target, port = dead_collector
    timeout = 1.0
    out = run_scenario(
        "otlp",
        {
            "endpoint": f"http://127.0.0.1:{port}",
            "export_timeout_s": 0.5,
            "shutdown_timeout_s": timeout,
        },
    )
    assert out["produced"] == 2  # spans were made; only their export failed
    assert isinstance(out["shutdown_ok"], bool)  # it came back (the bound: the test below)
    print(f"\nshutdown with the collector down ({target}): {out['shutdown_s']:.2f} s")


def test_shutdown_gives_up_on_a_provider_that_never_returns():
    """The bound is structural: a provider whose shutdown never returns (a dead collector at
    its worst) is left behind and the shutdown reports False, whatever the machine's speed."""
    import threading

    from sft_runtime.runtime.config import TelemetryConfig
    from sft_runtime.traces.setup import Telemetry

    never = threading.Event()

    class Stuck:
        def shutdown(self, *args, **kwargs):
            never.wait()

    config = TelemetryConfig(enabled=True, exporters=["memory"], shutdown_timeout_s=0.2)
    tel = Telemetry(enabled=True, config=config, tracer_provider=Stuck())
    with pytest.warns(RuntimeWarning, match="could not shut down telemetry within 0.2 s"):
        assert tel.shutdown() is False
    assert tel.shutdown() is True  # idempotent: already closed
    never.set()


def _paths(server: ThreadingHTTPServer) -> set[str]:
    return {path for path, _, _ in server.requests}


def test_traces_and_metrics_each_have_a_switch_and_an_endpoint(run_scenario):
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Receiver) for _ in range(2)]
    for server in servers:
        server.requests = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
        both = run_scenario("otlp", {"endpoint": url[0]})  # one base URL: both signals
        assert both["shutdown_ok"] and _paths(servers[0]) == {"/v1/traces", "/v1/metrics"}
        servers[0].requests.clear()
        run_scenario("otlp", {"endpoint": url[0], "otlp_metrics": False})  # a traces-only backend
        assert _paths(servers[0]) == {"/v1/traces"}
        servers[0].requests.clear()
        run_scenario("otlp", {"endpoint": url[0], "env": {"OTEL_METRICS_EXPORTER": "none"}})
        assert _paths(servers[0]) == {"/v1/traces"}
        servers[0].requests.clear()
        split = {"traces_endpoint": f"{url[0]}/t", "metrics_endpoint": f"{url[1]}/m"}
        run_scenario("otlp", split)  # full signal URLs, one backend each
        assert _paths(servers[0]) == {"/t"} and _paths(servers[1]) == {"/m"}
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_one_deadline_serves_every_flush_of_a_shutdown():
    """A flush gets only what is left of the run's shutdown deadline, and once a flush has
    given up on the collector the final shutdown does not wait for it again."""
    import time

    from sft_runtime.runtime.config import TelemetryConfig
    from sft_runtime.traces.setup import Telemetry

    never = threading.Event()

    class Stuck:
        def force_flush(self, *args, **kwargs):
            never.wait()

        shutdown = force_flush

    config = TelemetryConfig(enabled=True, exporters=["memory"], shutdown_timeout_s=3600.0)
    tel = Telemetry(enabled=True, config=config, tracer_provider=Stuck())
    with pytest.warns(RuntimeWarning, match="within 0.0 s"):
        assert tel.force_flush(deadline=time.time() - 1) is False  # the deadline has passed
    assert tel.gave_up
    with pytest.warns(RuntimeWarning, match="within 0.1 s"):
        assert tel.shutdown() is False  # not another hour on the same dead collector
    never.set()


def test_a_flush_hands_on_what_it_left_of_the_shutdown_budget():
    """The controller and then the driver flush on what the processes before them left: a
    flush that answered at once leaves nearly all of it, one that gave up leaves nothing."""
    from sft_runtime.runtime.config import TelemetryConfig
    from sft_runtime.traces.setup import Telemetry

    never = threading.Event()

    class Quick:
        def force_flush(self, *args, **kwargs):
            return True

    class Stuck:
        def force_flush(self, *args, **kwargs):
            never.wait()

    config = TelemetryConfig(enabled=True, exporters=["memory"], shutdown_timeout_s=3600.0)
    quick = Telemetry(enabled=True, config=config, tracer_provider=Quick())
    assert 3000.0 < quick.flush_within(None) <= 3600.0  # None: the whole shutdown_timeout_s
    assert 0.0 < quick.flush_within(1800.0) <= 1800.0
    stuck = Telemetry(enabled=True, config=config, tracer_provider=Stuck())
    with pytest.warns(RuntimeWarning, match="within 0.2 s"):
        assert stuck.flush_within(0.2) == 0.0
    assert stuck.gave_up
    never.set()
    assert 0.0 < Telemetry().flush_within(1.5) <= 1.5  # telemetry off: nothing to spend
