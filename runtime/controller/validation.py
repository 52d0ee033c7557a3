"""`Validator`: when the controller runs a validation pass, and what it records of one.

A pass follows step N's commit (and comes before step N's checkpoint, which it may rank), or
comes before the first step with ``sft.val_at_start``. Its loss is the mean NLL over every
supervised token of the validation samples: each worker returns its summed NLL and tokens,
and the sums are added here, so ranks weigh by their tokens as in training.

The log decides what is done: a resume reads the validations in effect, so a pass the log
holds for the step the run resumes at is neither repeated nor skipped, and the latest one's
loss ranks a checkpoint whose step had none of its own (as NeMo RL keeps the last value).
"""

from __future__ import annotations

import time
from typing import Any

from sft_runtime.events.lineage import records_in_effect
from sft_runtime.runtime.config import MasterConfig
from sft_runtime.runtime.metrics.step_metrics import sample_digest
from sft_runtime.runtime.process.faults import fault_point
from sft_runtime.runtime.validation.config import validation_spec
from sft_runtime.states import fold
from sft_runtime.traces.context import inject_carrier
from sft_runtime.traces.spans import VALIDATION_SPAN, traced


class Validator:
    """The run's validation passes: due or not, run, recorded."""

    def __init__(self, config: MasterConfig, group: Any) -> None:
        self.config = config
        self.group = group
        self.spec = validation_spec(config)
        self.latest: dict[str, Any] = {}  # the metrics of the latest validation in effect
        # steps whose validation the log holds (`StepRules.after` then schedules none)
        self.done: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.spec is not None

    def read_log(self, log: Any) -> None:
        """The validations in effect in the run's log (a resume starts from them)."""
        if not self.enabled:
            return
        for rec in records_in_effect(log):
            if rec.type == "validation_completed":
                self.done.add(rec.data["step"])
                self.latest = _metrics(rec.data)

    def run(self, step: int, model: Any, attempt: int | None) -> dict[str, Any]:
        """One pass on the weights after ``step``; recorded through ``model.validated``."""
        t0 = time.perf_counter()
        with traced(VALIDATION_SPAN, attributes={"step": step, "attempt": attempt}) as span:
            outs = self.group.validate(self.spec, carrier=inject_carrier())
            fault_point("validating:after_pass", step=step, attempt=attempt)
            nll = sum(o.nll_sum for o in outs)
            tokens = sum(o.tokens for o in outs)
            metrics = {
                "val_loss": nll / max(tokens, 1),
                "val_tokens": tokens,
                "val_samples": sum(o.samples for o in outs),
                "val_time": time.perf_counter() - t0,
            }
            span.set_attribute("sft.val.loss", metrics["val_loss"])
            ctx = span.get_span_context()
            trace_id = f"{ctx.trace_id:032x}" if ctx.is_valid else None
            span_id = f"{ctx.span_id:016x}" if ctx.is_valid else None
            event = fold.validation_completed_event(
                step,
                metrics,
                sample_digest=sample_digest(_in_order([o.source_ids for o in outs])),
                trace_id=trace_id,
                span_id=span_id,
            )
            model.validated(event=event)
        self.done.add(step)
        self.latest = metrics
        return metrics


def _in_order(shares: list[list[str]]) -> list[str]:
    """The pass's sample ids in stored order: rank r holds positions r, r + W, r + 2W, ..."""
    world = len(shares)
    out: list[str] = []
    for i in range(max((len(s) for s in shares), default=0)):
        out.extend(shares[r][i] for r in range(world) if i < len(shares[r]))
    return out


def _metrics(data: dict[str, Any]) -> dict[str, Any]:
    return {
        "val_loss": data["loss"],
        "val_tokens": data["tokens"],
        "val_samples": data["samples"],
        "val_time": data.get("seconds", 0.0),
    }
