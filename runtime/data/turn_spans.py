"""Where each assistant turn of a conversation lies in its whole render, from prefix renders.

A chat template without ``{% generation %}`` markers does not say which characters are the
assistant's, but it can be asked: a turn starts where the render of the messages before it
with the generation prompt ends, and ends where the render including it ends. When both are
prefixes of the whole render (Llama 3, ChatML) that is exact, and it is all there is to it.

Some templates render a turn differently once later messages follow. Qwen3 drops an
assistant turn's ``<think>`` block once a later user message exists, so the render ending
with turn i shows a think block the whole render does not; with ``enable_thinking=False``
its generation prompt ends in an empty think block that no rendered turn has. Training
follows the whole render, the conversation as the model sees it as history at inference:
every assistant turn is supervised as it appears there (earlier Qwen3 turns without their
think block, the last one with it), located by the renders that still agree with it:

- start: when the generation prompt is not a prefix of the whole render, the render of the
  messages before the turn must be; the turn starts after the assistant header, the
  longest text that follows those messages alike in the whole render, in the generation
  prompt, and (when the template renders it) in a probe where two assistant turns that say
  only a sentinel character follow those messages. The probe keeps an empty think block
  in the prompt, or a reply that happens to begin like the prompt's tail, out of the
  header.
- end: the last message ends with the whole render; otherwise the render ending with the
  turn, when it is a prefix; otherwise the render through the message after the turn must
  be a prefix, and the turn ends after the first special token (its end-of-turn token)
  from its start on. Tool results that follow one another may render as one turn (Qwen's
  templates), which only the render through the last of them closes as the whole render
  does: the render through that last one bounds the search then.

Anything else (a template that also rewrites the messages before a turn, or the message
after it) cannot be located this way and is refused, naming the message: such a template
needs ``{% generation %}`` markers. Whitespace a template puts after a turn's end-of-turn
token is layout, not the turn's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

Messages = list[dict[str, Any]]
Span = tuple[int, int]
Render = Callable[..., str]  # render(messages, add_generation_prompt=bool) -> text

TEMPLATE_KEY = "policy.tokenizer.chat_template"
SENTINEL = "\x00"  # the probe assistant turn's content: no reply begins with it


class TurnNotLocatedError(ValueError):
    """A template renders a conversation so that prefix renders cannot find a turn."""


def assistant_spans(
    render: Render,
    messages: Messages,
    whole: str,
    turns: Sequence[int],
    closers: tuple[str, ...],
    *,
    headers: Collection[int] = (),
) -> list[Span]:
    """Half-open character spans in `whole` (the render of `messages`) of the assistant
    messages at `turns`; `closers` are the tokenizer's special tokens. A turn in `headers`
    starts with its header (data.add_generation_prompt, chat_format.py): where the render of
    the messages before it stops agreeing with `whole`."""
    renders = _PrefixRenders(render, messages, whole)
    return [_span(renders, index, closers, index in headers) for index in turns]


def _span(renders: _PrefixRenders, index: int, closers: tuple[str, ...], header: bool) -> Span:
    if index == 0:
        raise TurnNotLocatedError(
            "the conversation opens with an assistant message: without {% generation %} "
            "markers in the chat template its start cannot be told from the template's "
            "preamble"
        )
    start = _start(renders, index)
    end = _end(renders, index, start, closers)  # from the reply: the header has closers too
    if header:
        start = min(start, common_prefix(renders.whole, renders.get(index)))
    body = renders.whole[start:end]
    kept = body.rstrip()
    if kept != body and kept.endswith(closers):
        end = start + len(kept)
    return start, max(start, end)


def _start(renders: _PrefixRenders, index: int) -> int:
    whole = renders.whole
    prompt = renders.get(index, prompt=True)
    if whole.startswith(prompt):
        return len(prompt)
    context = renders.get(index)
    start = common_prefix(whole, prompt)
    probe = renders.probe(index)
    if probe is not None:
        start = min(start, common_prefix(whole, probe))
    if start < len(context):  # the whole render or the prompt rewrites what came before
        raise _not_located(index)
    return start


def _end(renders: _PrefixRenders, index: int, start: int, closers: tuple[str, ...]) -> int:
    whole = renders.whole
    if index + 1 == renders.count:
        return len(whole)
    through = renders.get(index + 1)
    if whole.startswith(through):
        return len(through)
    after = index + 2  # the messages through the one after the turn, then its fellow results
    while not whole.startswith(renders.get(after)):
        if not _grouped_results(renders.messages, after):
            raise _not_located(index)
        after += 1
    limit = len(renders.get(after))
    ends = [(at, at + len(c)) for c in closers if (at := whole.find(c, start, limit)) >= 0]
    if not ends:
        raise _not_located(index)
    return min(ends, key=lambda found: (found[0], -found[1]))[1]  # the first, then longest


def _grouped_results(messages: Messages, count: int) -> bool:
    """Whether the `count` first messages end in a tool result that another one follows
    (templates may render such a run as one turn, closed after its last result)."""
    if not 0 < count < len(messages):
        return False
    return messages[count - 1].get("role") == "tool" and messages[count].get("role") == "tool"


class _PrefixRenders:
    """The renders of one conversation's leading messages, each made once (the render
    through the message after a turn is the one before the next turn)."""

    def __init__(self, render: Render, messages: Messages, whole: str) -> None:
        self.render = render
        self.messages = messages
        self.whole = whole
        self.count = len(messages)
        self._done: dict[tuple[int, bool], str] = {(self.count, False): whole}

    def get(self, count: int, *, prompt: bool = False) -> str:
        """The render of the first `count` messages (with the generation prompt)."""
        key = (count, prompt)
        if key not in self._done:
            self._done[key] = self.render(self.messages[:count], add_generation_prompt=prompt)
        return self._done[key]

    def probe(self, count: int) -> str | None:
        """The first `count` messages, then two assistant turns that say only the sentinel:
        what the template writes before a reply that is not the last. (A user message after
        it would make Qwen3 re-render the turns before.) None when the template refuses it
        or renders the first messages otherwise."""
        reply = {"role": "assistant", "content": SENTINEL}
        try:
            text = self.render([*self.messages[:count], reply, reply], add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - only a bound; a template may refuse the probe
            return None
        return text if text.startswith(self.get(count)) else None


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b` (by halving: a character loop in
    Python would cost more than the renders)."""
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def _not_located(index: int) -> TurnNotLocatedError:
    return TurnNotLocatedError(
        f"the chat template renders the messages up to message {index} differently once "
        f"later messages follow, in a way prefix renders cannot locate assistant message "
        f"{index} in; use a template with {{% generation %}} markers ({TEMPLATE_KEY})"
    )
