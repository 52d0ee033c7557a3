"""Span ids from the OS, ids reserved for a root drawn later, and the next attempt's number."""

from __future__ import annotations

import random

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sft_runtime.events import LoadersReady, RunStarted
from sft_runtime.events.log import log_path, next_attempt, open_log
from sft_runtime.traces.ids import RunIdGenerator


def _ids_after_seeding(ids: RunIdGenerator) -> list[int]:
    random.seed(1234)  # what a training worker does with its seed
    return [ids.generate_span_id() for _ in range(4)] + [ids.generate_trace_id()]


def test_ids_do_not_come_from_the_training_rng_nor_move_it():
    ids = RunIdGenerator()
    assert _ids_after_seeding(ids) != _ids_after_seeding(ids)  # same seed, new ids
    random.seed(99)
    expected = random.random()
    random.seed(99)
    for _ in range(100):
        ids.generate_span_id()
        ids.generate_trace_id()
    assert random.random() == expected  # the stream training draws from is untouched


def test_a_reserved_pair_becomes_the_next_root_span_only():
    ids = RunIdGenerator()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    reserved = ids.reserve()
    with ids.use(reserved):
        tracer.start_span("root").end()
    tracer.start_span("other").end()
    root, other = exporter.get_finished_spans()
    assert (root.context.trace_id, root.context.span_id) == reserved
    assert other.context.span_id != reserved[1] and other.context.trace_id != reserved[0]


def test_next_attempt_reads_the_logs_tail(tmp_path):
    assert next_attempt(tmp_path) == 1  # no log yet
    for expected in (1, 2):
        log = open_log(tmp_path)
        assert log.attempt == expected == next_attempt(tmp_path)
        log.append(RunStarted(placement_hash="p"))
        log.append(LoadersReady(owner_ranks=[0], logical_world_size=1, restored=False))
        log.close()
    assert next_attempt(tmp_path) == 3
    with open(log_path(tmp_path), "ab") as fh:
        fh.write(b'{"seq": 99, "attempt": 7, "ty')  # a torn tail is not a record
    assert next_attempt(tmp_path) == 3
    log = open_log(tmp_path)  # the writer agrees (and cuts the torn tail)
    assert log.attempt == 3 and log.repaired is not None
    log.close()
