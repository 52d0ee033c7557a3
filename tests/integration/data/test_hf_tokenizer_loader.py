"""The colocated loader with a Hugging Face tokenizer: rows are the template's ids, the loss
mask is the assistant turns', and a changed template is a changed stream."""

from __future__ import annotations

import pytest

from sft_runtime.runtime.data.loader import LoaderStateMismatchError
from sft_runtime.runtime.data.task_encoder import encode_conversation
from sft_runtime.runtime.data.tokenizer import TokenizerSpec, build_tokenizer
from tests.support.hf_models import CHATML_TEMPLATE

pytest.importorskip("transformers")

PACKING = {"packing_algorithm": "first_fit_decreasing"}


def _spec(folder, chat_template: str | None = None) -> TokenizerSpec:
    return TokenizerSpec(name=str(folder), chat_template=chat_template or "default")


@pytest.mark.parametrize(
    ("model", "extra"), [("tiny_qwen2", {}), ("tiny_llama", PACKING)], ids=["chatml", "llama3"]
)
def test_rows_are_the_templates_tokens_and_masks(make_loader, demo_messages, request, model, extra):
    spec = _spec(request.getfixturevalue(model))
    tok = build_tokenizer(spec)
    loader = make_loader(tokenizer=spec, max_input_seq_length=128, **extra)
    assert loader.fingerprint()["tokenizer"] == tok.identity()
    for _ in range(3):
        envelope = loader.load()
        batch = loader.active_batch
        assert envelope.valid_tokens == batch.valid_tokens > 0
        segment = 0
        for r in range(batch.num_rows):
            bounds = batch.cu_seqlens[r]
            for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
                messages = demo_messages[batch.source_ids[segment]]
                ids, mask = encode_conversation(tok, messages, max_length=128)
                assert batch.input_ids[r, start:stop].tolist() == ids
                assert batch.loss_mask[r, start:stop].tolist() == mask
                segment += 1
            assert (batch.input_ids[r, bounds[-1] :] == tok.pad_id).all()
        loader.commit()


def test_a_state_saved_under_another_template_is_refused(make_loader, tiny_qwen2):
    first = make_loader(tokenizer=_spec(tiny_qwen2))
    first.load()
    first.commit()
    state = first.state_dict()
    unmarked = CHATML_TEMPLATE.replace("{%- generation -%}", "").replace(
        "{%- endgeneration -%}", ""
    )
    # Same ids and masks, but a different template: the loader cannot know that in general.
    with pytest.raises(LoaderStateMismatchError, match="tokenizer"):
        make_loader(tokenizer=_spec(tiny_qwen2, unmarked), state=state)
    make_loader(tokenizer=_spec(tiny_qwen2, CHATML_TEMPLATE), state=state)
