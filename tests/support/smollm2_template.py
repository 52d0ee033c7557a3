"""SmolLM2's chat template with the assistant's part marked by ``{% generation %}``.

SmolLM2-135M-Instruct ships a ChatML template (it is in the GGUF file the demo converts)
that injects a default system prompt when the first message is not a system one, and has no
generation markers. This variant renders the same text character for character, and marks
each assistant turn's content and its ``<|im_end|>`` (the newline after is layout), so that
transformers' ``return_assistant_tokens_mask=True``, and TRL's ``assistant_only_loss``, can
say which tokens are the assistant's. The real-model test holds the runtime's masks against
it; bench/real_model.py gives it to TRL.
"""

from __future__ import annotations

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n' }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
