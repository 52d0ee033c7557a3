"""The energon sample type of a prepared chat data set.

The prepared ``dataset.yaml`` names this class and maps the tar's ``json`` part onto it, so
``energon info``, energon's loaders and our task encoder all read the same samples. It must
stay importable under this name for data sets prepared earlier to keep loading. A data set
whose conversations define tools maps their ``tools`` too (prepare.py); one prepared
without them leaves the field at None.
"""

from __future__ import annotations

from megatron.energon import Sample, edataclass


@edataclass
class ChatSample(Sample):
    """One conversation, already validated (records.py): its messages (``{"role",
    "content"}``, with tool calls and results where it has them) and the tool definitions
    its every render gets (None: no tools)."""

    messages: list
    tools: list | None = None
