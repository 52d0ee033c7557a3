"""Samples a run cannot train on as they are, through the real `sft-runtime` command.

- A sample the chat template refuses (a system message under a Gemma-style template) stops
  the run at the step that draws it: exit 2, one line naming the sample and the template's
  words, the last checkpoint and the log intact; the same run resumed with
  ``data.skip_bad_samples=true`` goes on from that checkpoint, skips it and counts it.
- A sample longer than ``data.max_input_seq_length`` gets zero loss weight by default
  (NeMo RL's rule), is counted in the step's event, metrics and the final summary; the
  tokens the workers trained on (`sft-runtime samples`) show it. The run packs rows, so
  energon's "Filling reading buffer" bars would show if the workers printed them; and its
  tokenizer block gives only a chat template, which means the model's own tokenizer.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import orjson
import pytest
import yaml

from sft_runtime.events import read_log
from sft_runtime.runtime.data.demo import demo_conversation
from tests.support.fixtures import data_set_messages
from tests.support.reliability import Runner

pytest.importorskip("transformers")

SAMPLES = 128
BAD_STEP = 4  # the step whose batch on rank 0 holds the refused sample
LIMIT = 96


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


def _write_config(runner: Runner, change) -> None:
    raw = yaml.safe_load(runner.config.read_text())
    change(raw)
    runner.config.write_text(yaml.safe_dump(raw))


def _events(run_dir: Path, type_: str) -> list[dict]:
    return [r.data for r in read_log(run_dir) if r.type == type_]


# ------------------------------------------------------------------------ refused samples
def _conversations(count: int) -> list[list[dict[str, str]]]:
    rng = random.Random(5)
    chats = []
    for _ in range(count):  # the Gemma-style template takes no system message
        chats.append([m for m in demo_conversation(rng) if m["role"] != "system"])
    return chats


def _prepare(chats: list, out: Path) -> Path:
    from sft_runtime.runtime.data.prepare import prepare_jsonl

    source = out.with_suffix(".jsonl")
    source.write_bytes(b"".join(orjson.dumps({"messages": c}) + b"\n" for c in chats))
    prepare_jsonl(source, out, shard_size=32)
    return out


def _first_key_of(config_path: Path, rank: int, step: int) -> str:
    """The first sample of ``rank``'s batch at ``step``, read by a loader in this process
    (the order depends on the data set's layout and the seed, never on the contents)."""
    from sft_runtime.runtime.config import load_config, loader_spec
    from sft_runtime.runtime.data.loader import ColocatedLoader

    config = load_config(config_path)
    loader = ColocatedLoader(loader_spec(config, 2), rank, 2, "probe")
    loader.setup()
    try:
        for _ in range(step - 1):
            loader.load()
            loader.commit()
        return loader.load().source_ids[0]
    finally:
        loader.close()


@pytest.fixture(scope="module")
def gemma_model(tmp_path_factory) -> Path:
    from tests.support.hf_models import hf_model_dir

    return hf_model_dir(tmp_path_factory.mktemp("hf") / "tiny-gemma", template="gemma")


def test_a_refused_sample_stops_the_run_naming_it_and_a_resume_can_skip_it(
    gemma_model, launch_env, tmp_path
):
    chats = _conversations(SAMPLES)
    good = _prepare(chats, tmp_path / "good")
    ray_tmp, tag = launch_env
    overrides = (
        f"policy.model_name={gemma_model}",
        "data.max_input_seq_length=128",
        "checkpointing.save_period=2",
    )
    probe = Runner(tmp_path, good, ray_tmp, tag, name="probe", steps=6, overrides=overrides)
    key = _first_key_of(probe.config, rank=0, step=BAD_STEP)
    line = int(key.removeprefix("line"))
    chats[line - 1] = [{"role": "system", "content": "Be terse."}, *chats[line - 1]]
    bad = _prepare(chats, tmp_path / "bad")

    runner = Runner(tmp_path, bad, ray_tmp, tag, name="run", steps=6, overrides=overrides)
    message = _one_line_error(runner.cli(*runner.command[1:]))
    assert key in message and "System role not supported" in message
    assert "data.skip_bad_samples" in message
    committed = [e["step"] for e in _events(runner.run_dir, "step_committed")]
    assert committed == list(range(1, BAD_STEP))
    (aborted,) = _events(runner.run_dir, "step_aborted")
    assert aborted["step"] == BAD_STEP and aborted["phase"] == "loading"
    saved = [e["step"] for e in _events(runner.run_dir, "checkpoint_saved")]
    assert saved == [2]

    # nothing was lost: the same command, told to skip, resumes from step 2 and finishes
    _write_config(runner, lambda raw: raw["data"].update(skip_bad_samples=True))
    resumed = runner.cli(*runner.command[1:])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "1 sample(s) refused by the chat template were skipped" in resumed.stdout
    steps = {e["step"]: e for e in _events(runner.run_dir, "step_committed")}
    assert [steps[s]["skipped_samples"] for s in sorted(steps)] == [0, 0, 0, 1, 0, 0]
    verified = runner.cli("verify", str(runner.run_dir))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    rows = json.loads(
        runner.cli("samples", str(runner.run_dir), "--step", str(BAD_STEP), "--json").stdout
    )
    (skipped,) = [s for s in rows[0]["samples"] if s["source_id"] == key]
    assert skipped["supervised_tokens"] == 0


# ------------------------------------------------------------------------ overlong samples
VARIANT = "Cutting Knowledge Date: June 2024"  # tells the config's template from the folder's


def test_overlong_samples_are_weighted_zero_counted_and_reported(
    tiny_llama, demo_data, launch_env, tmp_path
):
    from transformers import AutoTokenizer

    from tests.support.hf_models import LLAMA3_TEMPLATE

    template = LLAMA3_TEMPLATE.replace("Cutting Knowledge Date: December 2023", VARIANT)
    assert template != LLAMA3_TEMPLATE
    ray_tmp, tag = launch_env
    overrides = (
        f"policy.model_name={tiny_llama}",
        f"data.max_input_seq_length={LIMIT}",
        "policy.sequence_packing.enabled=true",
        "checkpointing.save_period=1",  # `samples` replays a step from the checkpoint before
    )
    runner = Runner(tmp_path, demo_data, ray_tmp, tag, name="run", steps=3, overrides=overrides)

    def change(raw: dict) -> None:
        raw["data"].pop("overlong_samples")  # the default applies
        raw["policy"]["tokenizer"] = {"chat_template": template}  # no name, no path

    _write_config(runner, change)
    done = runner.cli(*runner.command[1:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "Filling reading buffer" not in output and "Traceback" not in output

    steps = _events(runner.run_dir, "step_committed")
    counts = [e["overlong_samples"] for e in steps]
    assert len(counts) == 3 and sum(counts) > 0  # and each step's count is checked below
    assert all(e["overlong_samples"] < e["source_samples"] for e in steps)
    metrics = [json.loads(line) for line in (runner.run_dir / "metrics.jsonl").open()]
    assert [m["train"]["overlong_samples"] for m in metrics] == counts
    assert f"{sum(counts)} sample(s) longer than data.max_input_seq_length" in done.stdout
    assert "trained with zero weight (data.overlong_samples=mask)" in done.stdout

    # the workers trained on what the config's template renders, overlong samples weighted 0
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    messages = data_set_messages(demo_data)
    for step in (2, 3):
        rows = json.loads(
            runner.cli("samples", str(runner.run_dir), "--step", str(step), "--json").stdout
        )
        overlong = variants = 0
        for sample in (s for row in rows for s in row["samples"]):
            ids = tok.apply_chat_template(
                messages[sample["source_id"]], chat_template=template, return_dict=True
            )["input_ids"]
            variants += VARIANT in tok.decode(ids)  # where no system message replaces it
            assert sample["token_ids"] == ids[:LIMIT]
            if len(ids) > LIMIT:
                overlong += 1
                assert sample["supervised_tokens"] == 0
            else:
                assert sample["supervised_tokens"] > 0
        assert overlong == counts[step - 1] and variants > 0
