"""prepare-data --tokenizer: the chat template renders every conversation before a shard is
written, so a data set the template refuses (Gemma refuses system messages) fails at
preparation, naming the line, instead of killing training at the step that draws it.

The CLI runs as a subprocess, as a user runs it: stderr, exit code and the output folder are
what is checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from sft_runtime.runtime.data.tokenizer import HFChatTokenizer  # noqa: E402
from tests.support.hf_models import hf_model_dir  # noqa: E402

CLI = str(Path(sys.executable).with_name("sft-runtime"))
SYSTEM_LINE = 3  # the line of `_lines()` that carries a system message
GOOD = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"prompt": "What is 2 + 3?", "response": "2 + 3 = 5"},
    {
        "messages": [
            {"role": "user", "content": "Multiply 4 by 5."},
            {"role": "assistant", "content": "20"},
            {"role": "user", "content": "And by 6?"},
            {"role": "assistant", "content": "24"},
        ]
    },
    {"prompt": "Echo: alpha beta", "response": "alpha beta"},
]
WITH_SYSTEM = {
    "messages": [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
}
# Renders an assistant turn only when it says something other than "(silent)"; the role
# header belongs to the turn (no generation prompt), so a dropped turn leaves no trace.
SILENCING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] != 'assistant' or m['content'] != '(silent)' %}"
    "{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + '<end_of_turn>\\n' }}"
    "{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    """A model folder with the Gemma-style tokenizer (system messages refused)."""
    return hf_model_dir(tmp_path_factory.mktemp("hf") / "tiny-gemma", template="gemma")


def _lines(with_system: bool = True) -> list[dict]:
    lines = list(GOOD)
    if with_system:
        lines.insert(SYSTEM_LINE - 1, WITH_SYSTEM)
    return lines


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _prepare(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CLI, "prepare-data", *map(str, args)], capture_output=True, text=True, timeout=180
    )


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def _num_samples(out: Path) -> int:
    info = json.loads((out / ".nv-meta" / ".info.json").read_text())
    return sum(info["shard_counts"].values())


def test_gemma_layout_supervises_each_reply_and_its_end_of_turn(gemma_dir):
    """The prefix-render mask of the gemma layout covers exactly each reply and its
    ``<end_of_turn>`` (the eos), not the "model" header nor the newline after the turn."""
    tok = HFChatTokenizer(str(gemma_dir))
    ids, mask = tok.encode_chat(GOOD[2]["messages"])
    hf = tok.hf_tokenizer
    assert ids == list(hf.apply_chat_template(GOOD[2]["messages"], tokenize=True)["input_ids"])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    supervised = [hf.decode(ids[i : i + 1]) for i, m in enumerate(mask) if m]
    assert "".join(supervised) == "20<end_of_turn>24<end_of_turn>"
    assert tok.eos_id == hf.convert_tokens_to_ids("<end_of_turn>")


def test_a_system_message_refused_by_the_template_fails_naming_the_line(tmp_path, gemma_dir):
    src = _write(tmp_path / "data.jsonl", _lines())
    out = tmp_path / "out"
    line = _one_error_line(_prepare(src, out, "--tokenizer", gemma_dir))
    assert f"{src}:{SYSTEM_LINE}:" in line
    assert "the chat template refuses this conversation: System role not supported" in line
    assert not out.exists(), "nothing is written when the template refuses a line"


def test_skip_bad_skips_the_refused_line_and_keeps_the_others(tmp_path, gemma_dir):
    src = _write(tmp_path / "data.jsonl", _lines())
    out = tmp_path / "out"
    result = _prepare(src, out, "--tokenizer", gemma_dir, "--skip-bad")
    assert result.returncode == 0, result.stderr
    assert f"skipped 1 bad line(s): {SYSTEM_LINE}" in result.stdout
    assert f"wrote {len(GOOD)} train and 0 val samples" in result.stdout
    assert _num_samples(out) == len(GOOD)


def test_without_tokenizer_the_same_data_is_accepted(tmp_path):
    src = _write(tmp_path / "data.jsonl", _lines())
    out = tmp_path / "out"
    result = _prepare(src, out)
    assert result.returncode == 0, result.stderr
    assert "skipped" not in result.stdout and "chat template" not in result.stdout
    assert _num_samples(out) == len(GOOD) + 1


def test_good_data_with_tokenizer_is_accepted(tmp_path, gemma_dir):
    src = _write(tmp_path / "data.jsonl", _lines(with_system=False))
    out = tmp_path / "out"
    result = _prepare(src, out, "--tokenizer", gemma_dir, "--val-fraction", "0.25")
    assert result.returncode == 0, result.stderr
    assert "every sample renders under the chat template" in result.stdout
    assert _num_samples(out) == len(GOOD)


def test_a_turn_the_template_drops_is_named_as_supervising_nothing(tmp_path, gemma_dir):
    """--chat-template replaces the folder's template; a conversation whose only reply it
    does not render leaves training nothing to learn, and is a bad line too."""
    template = tmp_path / "silencing.jinja"
    template.write_text(SILENCING_TEMPLATE)
    silent = {"prompt": "Say nothing.", "response": "(silent)"}
    src = _write(tmp_path / "data.jsonl", [GOOD[0], silent, WITH_SYSTEM])
    out = tmp_path / "out"
    args = (src, out, "--tokenizer", gemma_dir, "--chat-template", template)
    line = _one_error_line(_prepare(*args))
    assert f"{src}:2:" in line and "no supervised token" in line
    assert not out.exists()
    # the replacement accepts system messages: only the silent line is skipped
    result = _prepare(*args, "--skip-bad")
    assert result.returncode == 0, result.stderr
    assert "skipped 1 bad line(s): 2" in result.stdout
    assert _num_samples(out) == 2


@pytest.mark.parametrize("kind", ["missing", "empty", "corrupt", "no_template"])
def test_an_unusable_tokenizer_folder_is_one_line(tmp_path, kind):
    from tests.support.hf_models import train_tokenizer

    folder = tmp_path / "tok"
    if kind == "empty":
        folder.mkdir()
    elif kind == "corrupt":  # transformers' own error (a ValueError) becomes the one line
        folder.mkdir()
        (folder / "tokenizer.json").write_text("{not json")
    elif kind == "no_template":
        train_tokenizer(folder, ["user: hi", "assistant: hello"] * 20, template="none")
    src = _write(tmp_path / "data.jsonl", _lines(with_system=False))
    out = tmp_path / "out"
    line = _one_error_line(_prepare(src, out, "--tokenizer", folder))
    assert str(folder) in line
    expected = {
        "missing": "not a directory",
        "empty": "no tokenizer files",
        "corrupt": "cannot load a Hugging Face tokenizer",
        "no_template": "--chat-template FILE",
    }
    assert expected[kind] in line
    assert not out.exists()


def test_the_progress_bar_covers_the_render(tmp_path, gemma_dir, monkeypatch):
    """With a tokenizer the validation pass is the rendering pass: it runs under a bar
    labelled so, from the lower RENDER_PROGRESS_MIN_BYTES on, and every render happens
    while that bar is open."""
    import contextlib

    import sft_runtime.runtime.data.prepare as prepare

    bars: list[tuple[str, int | None]] = []
    open_bars: list[str] = []
    renders: list[list[str]] = []
    real_progress, real_reason = prepare._progress, prepare.render_reason

    @contextlib.contextmanager
    def spy_progress(total, label, min_bytes=None):
        bars.append((label, min_bytes))
        open_bars.append(label)
        with real_progress(total, label, min_bytes) as advance:
            yield advance
        open_bars.pop()

    def spy_reason(tokenizer, messages, tools=None):
        renders.append(list(open_bars))
        return real_reason(tokenizer, messages, tools)

    monkeypatch.setattr(prepare, "_progress", spy_progress)
    monkeypatch.setattr(prepare, "render_reason", spy_reason)
    monkeypatch.setattr(prepare, "RENDER_PROGRESS_MIN_BYTES", 0)
    src = _write(tmp_path / "data.jsonl", _lines(with_system=False))
    result = prepare.prepare_jsonl(src, tmp_path / "out", tokenizer=gemma_dir)
    assert result.num_train == len(GOOD)
    assert bars[0] == ("rendering", 0)
    assert renders == [["rendering"]] * len(GOOD)
