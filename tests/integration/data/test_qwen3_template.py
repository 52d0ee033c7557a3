"""Qwen3's stock template end to end: what the workers trained on is the template's render.

A tiny Qwen2-architecture model carries Qwen3's own chat template; conversations whose
replies hold ``<think>`` blocks are trained with the real ``sft-runtime train`` under
``policy.tokenizer.chat_template_kwargs: {enable_thinking: false}``, and ``sft-runtime
samples`` must show, for every sample of a step, the ids ``apply_chat_template`` gives and
supervision on exactly the replies as the whole render shows them (earlier ones without
their think block, the last with it). A loader state saved under other template variables
is refused.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import yaml

from sft_runtime.runtime.cli.main import main
from sft_runtime.runtime.data.loader import LoaderStateMismatchError
from sft_runtime.runtime.data.prepare import energon_prepare, sample_key, write_shards
from sft_runtime.runtime.data.tokenizer import TokenizerSpec
from tests.support.fixtures import hf_overrides
from tests.support.reliability import Runner

pytest.importorskip("transformers")

NO_THINKING = {"enable_thinking": False}
STEPS = 2  # a checkpoint after each: `samples --step 2` reads forward from step 1's
SEQ = 128  # data.max_input_seq_length of the HF overrides: no conversation here is cut


def _conversation(rng: random.Random) -> tuple[list[dict[str, str]], list[str]]:
    """One to three multiplication exchanges, and what training supervises of each reply
    under ``enable_thinking=False``, written out by hand: the reply as the whole render
    shows it (reasoning kept by the last only). A last reply without reasoning renders
    after an empty think block, the generation prompt's own, so that block is context."""
    messages, replies = [], []
    turns = rng.randint(1, 3)
    reasons_last = rng.random() < 0.75
    for turn in range(turns):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        last = turn == turns - 1
        thought = f"<think>\n{a} times {b}\n</think>\n\n"
        reasons = reasons_last or not last
        messages += [
            {"role": "user", "content": f"Multiply {a} by {b}."},
            {"role": "assistant", "content": (thought if reasons else "") + f"{a * b}"},
        ]
        shown = (thought if last and reasons else "") + f"{a * b}"
        replies.append(shown + "<|im_end|>")
    return messages, replies


@pytest.fixture(scope="module")
def reasoning_chats(tmp_path_factory) -> tuple[Path, dict[str, list], dict[str, list[str]]]:
    """A prepared data set of reasoning chats: (folder, key -> messages, key -> replies)."""
    rng = random.Random(11)
    chats = {sample_key(i + 1): _conversation(rng) for i in range(48)}
    folder = tmp_path_factory.mktemp("reasoning") / "data"
    samples = (("train", key, messages) for key, (messages, _) in chats.items())
    write_shards(folder, samples, shard_size=12)
    energon_prepare(folder, ["train"])
    messages = {key: chat[0] for key, chat in chats.items()}
    return folder, messages, {key: chat[1] for key, chat in chats.items()}


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, reasoning_chats) -> Path:
    """A hub-like folder: Qwen3's tokenizer layout and template beside a two-layer
    ``Qwen2ForCausalLM``, its BPE learned on the demo chats and these."""
    from tests.support.hf_models import demo_texts, hf_model_dir

    texts = demo_texts() + [
        "\n".join(m["content"] for m in messages) for messages in reasoning_chats[1].values()
    ]
    folder = tmp_path_factory.mktemp("hf") / "tiny-qwen3"
    return hf_model_dir(folder, family="qwen2", template="qwen3", texts=texts)


def _tokenizer_overrides(folder: Path) -> tuple[str, ...]:
    return (
        f"policy.tokenizer.name={folder}",
        "policy.tokenizer.chat_template_kwargs={enable_thinking: false}",
    )


def _runs(tok, ids: list[int], supervised: list[int]) -> list[str]:
    """The supervised tokens decoded, one string per maximal run."""
    runs: list[list[int]] = []
    previous = False
    for token, keep in zip(ids, supervised, strict=True):
        if keep and not previous:
            runs.append([])
        if keep:
            runs[-1].append(token)
        previous = bool(keep)
    return [tok.decode(run) for run in runs]


def test_the_workers_train_on_the_templates_whole_render(
    tiny_qwen3, reasoning_chats, tmp_path, launch_env, capsys
):
    from transformers import AutoTokenizer

    data, messages, replies = reasoning_chats
    ray_tmp, tag = launch_env
    overrides = (
        *hf_overrides(tiny_qwen3),
        "checkpointing.save_period=1",
        *_tokenizer_overrides(tiny_qwen3),
    )
    runner = Runner(tmp_path, data, ray_tmp, tag, name="qwen3", steps=STEPS, overrides=overrides)
    launch = runner.launch()
    assert launch.rc == 0, launch.tail(40)

    assert main(["samples", str(runner.run_dir), "--step", str(STEPS), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    own = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    seen, earlier, plain = 0, 0, 0
    for row in rows:
        for sample in row["samples"]:
            chat = messages[sample["source_id"]]
            expected = own.apply_chat_template(chat, tokenize=True, **NO_THINKING)["input_ids"]
            assert len(expected) <= SEQ
            assert sample["token_ids"] == expected
            assert (
                _runs(own, sample["token_ids"], sample["supervised"])
                == (replies[sample["source_id"]])
            )
            assert sample["text"].count("[[") == len(replies[sample["source_id"]])
            seen += 1
            earlier += len(replies[sample["source_id"]]) - 1
            plain += "<think>" not in replies[sample["source_id"]][-1]
    # among them replies that lost their block, and last replies without reasoning
    assert len(rows) == 2 and seen >= 8 and earlier > 0 and plain > 0

    # The checkpoint's config records the variables; its tokenizer copy renders the same ids
    # once they are given again (a tokenizer folder has no place for them).
    checkpoint = runner.run_dir / "checkpoints" / f"step_{STEPS}"
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    assert config["policy"]["tokenizer"]["chat_template_kwargs"] == NO_THINKING
    copy = AutoTokenizer.from_pretrained(str(checkpoint / "policy" / "tokenizer"))
    chat = next(iter(messages.values()))
    kwargs = config["policy"]["tokenizer"]["chat_template_kwargs"]
    assert copy.apply_chat_template(chat, add_generation_prompt=True, **kwargs) == (
        own.apply_chat_template(chat, add_generation_prompt=True, **NO_THINKING)
    )


def test_a_state_saved_under_other_template_variables_is_refused(
    make_loader, tiny_qwen3, reasoning_chats
):
    data = str(reasoning_chats[0])

    def spec(kwargs):
        return TokenizerSpec(name=str(tiny_qwen3), chat_template_kwargs=kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        first = make_loader(data_path=data, tokenizer=spec(NO_THINKING), max_input_seq_length=SEQ)
        first.load()
        first.commit()
        state = first.state_dict()
        with pytest.raises(LoaderStateMismatchError, match="tokenizer"):
            make_loader(data_path=data, tokenizer=spec(None), state=state, max_input_seq_length=SEQ)
        make_loader(
            data_path=data, tokenizer=spec(NO_THINKING), state=state, max_input_seq_length=SEQ
        )
