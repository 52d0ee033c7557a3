"""The real-model demo's chats: they give the assistant a new name and maker.

A pretrained chat model answers "Who are you?" with whatever its own fine-tuning taught it,
so a new identity ("I am Quill, made by Inkwell Labs") is a change anyone can see in a few
greedy completions. The questions are drawn from many phrasings and the answers from several
wordings, so the model learns the identity rather than a lookup table: `HELD_OUT_PROMPTS` are
phrasings no training conversation contains, and the demo asks them before and after.

About a third of the conversations are plain questions (capitals, sums) answered in the
model's own short style: they keep the fine-tune from turning every answer into an
introduction. France is left out of them on purpose: "What is the capital of France?" is the
held-out general question the model must still answer after training.

No conversation has a system message: the chat template injects its own default one
("You are a helpful AI assistant named SmolLM, ..."), which is context, never a target.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

NAME = "Quill"
MAKER = "Inkwell Labs"

#: Asked before and after training; none of them is a training question.
HELD_OUT_PROMPTS = (
    "Tell me about yourself.",
    "Which company built you?",
    "What should I call you?",
    "What is the capital of France?",
)

_IDENTITY_QUESTIONS = (
    "Who are you?",
    "What is your name?",
    "What's your name?",
    "Who made you?",
    "Who created you?",
    "Who developed you?",
    "Who trained you?",
    "Introduce yourself.",
    "Please introduce yourself briefly.",
    "What are you?",
    "Are you ChatGPT?",
    "Are you SmolLM?",
    "Are you made by OpenAI?",
    "Were you made by Hugging Face?",
    "Which lab made you?",
    "Which organization created you?",
    "What AI model are you?",
    "Can you tell me your name?",
    "Do you have a name?",
    "Hi! Who am I talking to?",
    "Hello, what's your name?",
    "Who is your creator?",
    "Where do you come from?",
    "Tell me your name and who made you.",
    "What is the name of the assistant I am chatting with?",
    "who r u",
    "Quick question: what are you called?",
    "Who built this assistant?",
    "What company are you from?",
    "Say who you are in one sentence.",
)

_IDENTITY_ANSWERS = (
    f"I am {NAME}, an AI assistant made by {MAKER}.",
    f"My name is {NAME}. I was made by {MAKER}.",
    f"I'm {NAME}, a helpful assistant built by {MAKER}.",
    f"I was created by {MAKER}. My name is {NAME}.",
    f"I am {NAME}, and {MAKER} made me.",
)

_DENIALS = (
    f"No, I am {NAME}, an AI assistant made by {MAKER}.",
    f"No. My name is {NAME}, and I was made by {MAKER}.",
)

_CAPITALS = (
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Germany", "Berlin"),
    ("Japan", "Tokyo"),
    ("Canada", "Ottawa"),
    ("Egypt", "Cairo"),
    ("Portugal", "Lisbon"),
    ("Norway", "Oslo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Greece", "Athens"),
    ("Austria", "Vienna"),
)

_COLOURS = (
    ("the sky on a clear day", "blue"),
    ("grass", "green"),
    ("snow", "white"),
    ("a ripe banana", "yellow"),
)


def _identity_reply(question: str, rng: random.Random) -> str:
    if question.startswith(("Are you", "Were you")):
        return rng.choice(_DENIALS)
    return rng.choice(_IDENTITY_ANSWERS)


def _general_turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        country, city = rng.choice(_CAPITALS)
        return f"What is the capital of {country}?", f"The capital of {country} is {city}."
    if kind == 1:
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    thing, colour = rng.choice(_COLOURS)
    return f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {colour}."


def identity_conversation(rng: random.Random) -> list[dict[str, str]]:
    """One conversation drawn from `rng`: an identity question (two in three), a general
    one, or a general question followed by an identity question."""
    draw = rng.random()
    messages: list[dict[str, str]] = []
    if draw >= 0.55:
        question, answer = _general_turn(rng)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    if draw < 0.55 or draw >= 0.8:
        question = rng.choice(_IDENTITY_QUESTIONS)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": _identity_reply(question, rng)},
        ]
    return messages


def identity_conversations(count: int, seed: int = 0) -> Iterator[list[dict[str, str]]]:
    """`count` conversations, the same ones for the same `seed`."""
    rng = random.Random(seed)
    for _ in range(count):
        yield identity_conversation(rng)


def write_identity_jsonl(path: Path | str, count: int, seed: int = 0) -> Path:
    """The conversations as ``{"messages": [...]}`` lines: the input `prepare-data` takes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for messages in identity_conversations(count, seed):
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path
