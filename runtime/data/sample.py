"""The energon sample type of a prepared chat data set.

The prepared ``dataset.yaml`` names this class and maps the tar's ``json`` part onto it, so
``energon info``, energon's loaders and our task encoder all read the same samples. It must
stay importable under this name for data sets prepared earlier to keep loading.
"""

from __future__ import annotations

from megatron.energon import Sample, edataclass


@edataclass
class ChatSample(Sample):
    """One conversation: a list of ``{"role", "content"}`` messages, already validated."""

    messages: list
