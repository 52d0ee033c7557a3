"""Token ids and assistant-only supervision from a Hugging Face tokenizer's own chat template.

A fine-tuned chat model is only as good as the agreement between training and inference
tokenization, so a conversation is rendered by the tokenizer's template exactly once and that
text is tokenized exactly once, with ``add_special_tokens=False``: the ids are then those of
``tokenizer.apply_chat_template(messages, tokenize=True)``, token for token, plus the BOS and
EOS that ``data.add_bos`` and ``data.add_eos`` add where the render lacks them, and
``data.add_generation_prompt`` decides whether an assistant turn's header is supervised
(chat_format.py: NeMo RL's rules). Tokenizing
messages one by one would differ wherever BPE merges across a message boundary, and adding
special tokens would double the BOS of templates that emit it themselves (Llama 3).

The supervised tokens are the assistant turns as the template renders them, end-of-turn token
included (the model must learn to stop); what the template injects (role headers, default
system prompts, dates) is context. Turns are located in the rendered text, never by searching
for the raw content, since templates trim, rewrite and re-render it:

- a template with ``{% generation %}`` markers says itself which characters are the
  assistant's; transformers maps them onto the tokens (``return_assistant_tokens_mask``);
- any other template is asked where each assistant turn starts (the render of the messages
  before it with the generation prompt) and ends (the render including it), which is exact
  when both are prefixes of the whole render. Templates that re-render earlier turns once
  later messages follow (Qwen3 drops their think blocks) are trained on as they render the
  whole conversation, each turn as it appears there: turn_spans.py has the rules.

Template variables a template reads besides the messages (Qwen3's ``enable_thinking``) come
from ``policy.tokenizer.chat_template_kwargs`` and go into every render, as keyword
arguments of ``apply_chat_template`` do. A conversation's tool definitions (chat_format.py)
go into every render of it as ``apply_chat_template(..., tools=tools)``, as NeMo RL passes
them: where the template writes them (the system block) is context, and an assistant turn
that calls a tool is supervised as rendered, its calls included.

Character spans become tokens through the offsets of the one tokenization: a token belongs
to a turn when its characters overlap the turn's, so merges at a boundary cannot shift it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from sft_runtime.runtime.data import turn_spans
from sft_runtime.runtime.data.chat_format import RENDERED_FORMAT, ChatFormat
from sft_runtime.runtime.data.turn_spans import TEMPLATE_KEY, Messages, Span
from sft_runtime.runtime.errors import UserInputError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Used to check a template once, when the tokenizer is built, rather than per sample.
_PROBE = [
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Once more."},
    {"role": "assistant", "content": "Hello again."},
]
# What a direct render must agree on with transformers' (see `ChatTemplate`).
_PROBES = (
    _PROBE,
    _PROBE[:1],
    _PROBE[:3],
    [{"role": "system", "content": "Be brief.\n"}, *_PROBE[:2]],
)

# Names ``apply_chat_template`` or the render itself takes: not template variables.
RESERVED_TEMPLATE_KWARGS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt "
    "continue_final_message tokenize sanitize_control_tokens padding truncation max_length "
    "return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs".split()
)
TemplateKwargs = dict[str, Any]
Tools = list[dict[str, Any]] | None  # a conversation's tool definitions (None: no tools)


def resolve_template(tokenizer: Any, override: str | None, *, path: str) -> str:
    """The Jinja source that will render conversations: `override` (the config's
    ``policy.tokenizer.chat_template``) when given, else the tokenizer's own default."""
    if override is not None:
        if not override.strip():
            raise UserInputError(f"{TEMPLATE_KEY} is empty")
        return override
    if tokenizer.chat_template is None:
        raise UserInputError(
            f"policy.tokenizer.name {path!r}: the tokenizer has no chat template; set "
            f"{TEMPLATE_KEY} to the Jinja template its model was trained with"
        )
    try:
        return str(tokenizer.get_chat_template())
    except ValueError as exc:  # named templates but none called "default"
        raise UserInputError(f"policy.tokenizer.name {path!r}: {exc}; set {TEMPLATE_KEY}") from exc


def template_digest(template: str) -> str:
    """A short stable digest of a template: part of the tokenizer's identity, because the
    same vocabulary under another template yields other ids for the same conversation."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


def has_generation_markers(template: str) -> bool:
    return _GENERATION_TAG.search(template) is not None


def render(
    tokenizer: Any,
    messages: Messages,
    template: str,
    *,
    add_generation_prompt: bool = False,
    template_kwargs: TemplateKwargs | None = None,
    tools: Tools = None,
) -> str:
    """The template's text for `messages` (no tokenization), as transformers renders it,
    with `template_kwargs` as template variables and `tools` as the tool definitions."""
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )


class ChatTemplate:
    """A tokenizer's chat template, set up once to render and tokenize many conversations.

    Every sample read is rendered once per assistant turn and once whole, and most of what
    ``apply_chat_template`` spends on a render is converting its input to plain data
    (it accepts message objects, dataclasses, reasoning fields under several names), not the
    template itself. A conversation that is already plain (each message a dict of string
    ``role`` and ``content``, as the data sets hold them, and no tools) is rendered by the
    same compiled template with the same variables directly, which is what those
    conversions reduce it to; anything else goes through ``apply_chat_template``. The direct
    render is checked against ``apply_chat_template`` here, and not used if they differ on a
    probe conversation. The tokenizer's special tokens are read here: build it after they
    are final.
    """

    def __init__(
        self, tokenizer: Any, template: str, template_kwargs: TemplateKwargs | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.template_kwargs: TemplateKwargs = dict(template_kwargs or {})
        self.marked = has_generation_markers(template)
        self.closers = _special_strings(tokenizer)
        self._direct = _direct_renderer(tokenizer, template, self.template_kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_direct": None}  # a compiled template does not pickle

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._direct = _direct_renderer(self.tokenizer, self.template, self.template_kwargs)

    @property
    def renders_directly(self) -> bool:
        """Whether plain conversations skip ``apply_chat_template`` (see the class)."""
        return self._direct is not None

    def render(
        self, messages: Messages, *, add_generation_prompt: bool = False, tools: Tools = None
    ) -> str:
        if self._direct is not None and tools is None and _plain(messages):
            return self._direct(messages, add_generation_prompt=add_generation_prompt)
        return render(
            self.tokenizer,
            messages,
            self.template,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=self.template_kwargs,
            tools=tools,
        )

    def encode_prompt(
        self, messages: Messages, *, chat_format: ChatFormat | None = None, tools: Tools = None
    ) -> list[int]:
        """Ids of `messages` (with `tools`) followed by the assistant header, as a generation
        prompt (with the BOS a training row of `chat_format` starts with)."""
        text = self.render(messages, add_generation_prompt=True, tools=tools)
        text = (chat_format or RENDERED_FORMAT).bos_to_add(text, self.tokenizer.bos_token) + text
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokenize(
        self,
        messages: Messages,
        *,
        only_unmask_final: bool = False,
        chat_format: ChatFormat | None = None,
        tools: Tools = None,
    ) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation (every render with `tools`) and, per
        token, whether it is supervised, under `chat_format`'s BOS, EOS and header rules
        (chat_format.py; without one, `RENDERED_FORMAT`).

        With `only_unmask_final` only the last assistant turn is. A conversation without an
        assistant turn gets an all-False mask (callers skip it rather than train on nothing).
        """
        fmt = chat_format or RENDERED_FORMAT
        renders = partial(self.render, tools=tools)
        text = renders(messages)
        bos = fmt.bos_to_add(text, self.tokenizer.bos_token)
        eos = fmt.eos_to_add(text, self.tokenizer.eos_token)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        headed = {i for i in turns if fmt.header_supervised(messages, i)}
        if self.marked and not (bos or eos or headed):  # the template's own marks, as they are
            return _by_generation_markers(
                self.tokenizer,
                messages,
                self.template,
                only_unmask_final,
                self.template_kwargs,
                tools,
            )
        if self.marked:
            marked = self._marked_spans(messages, text, len(turns), tools)
            spans = dict(zip(turns, marked, strict=True))
            if only_unmask_final:
                turns = turns[-1:]
            spans = {
                i: (self._header_start(renders, messages, text, i), spans[i][1])
                if i in headed
                else spans[i]
                for i in turns
            }
        else:
            if only_unmask_final:
                turns = turns[-1:]
            located = turn_spans.assistant_spans(
                renders, messages, text, turns, self.closers, headers=headed
            )
            spans = dict(zip(turns, located, strict=True))
        whole = bos + text + eos
        out = [(start + len(bos), end + len(bos)) for start, end in spans.values()]
        if eos and out and turns[-1] == len(messages) - 1:
            out[-1] = (out[-1][0], len(whole))  # the EOS is the last message's
        ids, offsets = _encode_with_offsets(self.tokenizer, whole)
        return ids, tokens_in_spans(offsets, out)

    @staticmethod
    def _header_start(renders: Callable[..., str], messages: Messages, text: str, i: int) -> int:
        """Where assistant message `i`'s chunk starts when its header is its own: where the
        render (`renders`) of the messages before it stops agreeing with the whole render."""
        return turn_spans.common_prefix(text, renders(messages[:i]))

    def _marked_spans(
        self, messages: Messages, text: str, count: int, tools: Tools = None
    ) -> list[Span]:
        """The character spans of the template's ``{% generation %}`` blocks in `text` (its
        render of `messages` with `tools`), one per assistant message (`count` of them)."""
        ids, mask = _by_generation_markers(
            self.tokenizer, messages, self.template, False, self.template_kwargs, tools
        )
        own, offsets = _encode_with_offsets(self.tokenizer, text)
        if own != ids:
            raise turn_spans.TurnNotLocatedError(
                "apply_chat_template tokenizes this conversation otherwise than its render; "
                "its {% generation %} blocks cannot be located in the text"
            )
        runs: list[Span] = []
        for k, marked in enumerate(mask):
            if not marked:
                continue
            if runs and mask[k - 1]:
                runs[-1] = (runs[-1][0], offsets[k][1])
            else:
                runs.append((offsets[k][0], offsets[k][1]))
        if len(runs) != count:
            raise turn_spans.TurnNotLocatedError(
                f"the chat template marks {len(runs)} {{% generation %}} block(s) in a "
                f"conversation of {count} assistant message(s); they cannot be paired"
            )
        return runs


_PLAIN_KEYS = frozenset({"role", "content"})


def _plain(messages: Messages) -> bool:
    """Whether ``apply_chat_template``'s conversions would hand `messages` to the template
    as they are: dicts of string ``role`` and ``content``, nothing else."""
    for message in messages:
        if type(message) is not dict or not message.keys() <= _PLAIN_KEYS:
            return False
        if not all(type(value) is str for value in message.values()):
            return False
    return True


def _direct_renderer(
    tokenizer: Any, template: str, template_kwargs: TemplateKwargs
) -> Callable[..., str] | None:
    """A render of plain conversations by transformers' compiled template with the
    variables ``apply_chat_template`` passes it (the special tokens, then `template_kwargs`
    over them), or None when it cannot be had or renders the probe conversations
    otherwise."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template)
    except Exception:  # noqa: BLE001 - another transformers, or a template it refuses
        return None
    variables = dict(tokenizer.special_tokens_map)
    if not all(_strings(value) for value in variables.values()):
        return None  # transformers would turn other objects into placeholders
    if not _json_plain(template_kwargs):
        return None  # transformers rebuilds them out of plain types first
    variables.update(template_kwargs)

    def direct(messages: Messages, *, add_generation_prompt: bool) -> str:
        return compiled.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    for messages in _PROBES:
        for prompt in (False, True):
            if _outcome(direct, messages, prompt) != _outcome(
                partial(render, tokenizer, template=template, template_kwargs=template_kwargs),
                messages,
                prompt,
            ):
                return None
    return direct


def _outcome(render_fn: Callable, messages: Messages, prompt: bool) -> str | tuple[str, str]:
    """The text, or the kind of error, a render gives (a template may refuse a probe, such
    as a system message, as long as both renders refuse it alike)."""
    try:
        return render_fn(messages, add_generation_prompt=prompt)
    except Exception as exc:  # noqa: BLE001 - compared, not handled
        return ("error", type(exc).__name__)


def _strings(value: Any) -> bool:
    if type(value) is str:
        return True
    return type(value) is list and all(type(item) is str for item in value)


def _json_plain(value: Any) -> bool:
    """Whether `value` is made of exact JSON types only (what transformers hands a template
    unchanged)."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is list:
        return all(_json_plain(item) for item in value)
    if type(value) is dict:
        return all(type(k) is str and _json_plain(v) for k, v in value.items())
    return False


def _by_generation_markers(
    tokenizer: Any,
    messages: Messages,
    template: str,
    only_unmask_final: bool,
    template_kwargs: TemplateKwargs | None = None,
    tools: Tools = None,
) -> tuple[list[int], list[bool]]:
    encoded = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **(template_kwargs or {}),
    )
    ids = list(encoded["input_ids"])
    mask = [bool(m) for m in encoded["assistant_masks"]]
    if only_unmask_final:
        # One generation block per assistant turn, separated by the next turn's header:
        # the final turn is the last run of marked tokens.
        end = max((i + 1 for i, m in enumerate(mask) if m), default=0)
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        mask = [start <= i < end for i in range(len(mask))]
    return ids, mask


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets of `text`, as ``tokenizer(text, add_special_tokens=False)``
    gives them. The Rust tokenizer is asked directly when it is set up as that call would
    set it (no truncation, no padding, special tokens kept whole unless the tokenizer splits
    them): the call's argument checks and conversions cost as much as the encoding itself,
    once per sample read. Otherwise the call runs, and leaves the backend set up so."""
    backend = tokenizer.backend_tokenizer
    if (
        backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)
    ):
        encoding = backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), list(encoded["offset_mapping"])


def _special_strings(tokenizer: Any) -> tuple[str, ...]:
    return tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)


def tokens_in_spans(offsets: list[tuple[int, int]], spans: list[Span]) -> list[bool]:
    """Per token (character offsets), whether it overlaps one of `spans` (half-open, any
    order). A token with no characters counts as the point it sits at. Vectorized: it runs
    for every sample read, and a Python loop over the tokens would cost a third of a chat's
    tokenization, more the longer the chat."""
    if not offsets:
        return []
    out = np.zeros(len(offsets), dtype=bool)
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts = bounds[:, 0]
    ends = np.maximum(bounds[:, 1], starts + 1)
    for start, end in spans:
        if end > start:
            out |= (starts < end) & (ends > start)
    return out.tolist()


def check_template(chat: ChatTemplate, *, path: str) -> None:
    """Fail at start-up, naming the config key, when the template cannot render a plain chat
    or supervises nothing in it, rather than skipping every sample later."""
    try:
        _, mask = chat.tokenize(_PROBE)
    except Exception as exc:  # a template error can be any type (jinja2, ValueError, ...)
        raise UserInputError(
            f"policy.tokenizer.name {path!r}: the chat template cannot render a user/assistant "
            f"chat ({type(exc).__name__}: {exc}); check {TEMPLATE_KEY}"
        ) from exc
    if not any(mask):
        raise UserInputError(
            f"policy.tokenizer.name {path!r}: the chat template marks no assistant token in a "
            f"user/assistant chat (empty {{% generation %}} blocks?); check {TEMPLATE_KEY}"
        )
