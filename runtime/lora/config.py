"""`policy.dtensor_cfg.lora_cfg`: low-rank adapters on a frozen Hugging Face model.

The keys and their meanings are those of NeMo RL's ``policy.dtensor_cfg.lora_cfg``, so a
block copied from a NeMo RL config works as is or is refused naming the key:

- ``match_all_linear`` (the default) adapts every ``nn.Linear`` of the model, the LM head
  included, as NeMo RL does, except an LM head tied to the input embedding: merging an
  adapter into a tied head would change the embedding too, so it is left out (the only
  difference from NeMo RL, which leaves tying to the user).
- ``target_modules`` names the linear layers to adapt instead (with
  ``match_all_linear: false``: NeMo RL lets ``match_all_linear`` override the list, which
  is refused here rather than ignoring the list silently), ``exclude_modules`` the ones to
  leave out of "every linear layer"; the two are exclusive, as in NeMo RL. A name is a
  module's last component (``q_proj``), its full name, or a wildcard pattern over the full
  name (``*.layers.0.*``); one that matches no linear layer is refused.
- ``dim`` is the rank r and ``alpha`` the scale's numerator (the update is ``alpha/dim``
  times ``B A x``).
- ``dropout`` is applied to the adapter's input, which is what peft does and NeMo RL calls
  ``pre``; peft has no ``post`` position, so ``dropout_position: post`` with a non-zero
  ``dropout`` is refused (with ``dropout: 0``, NeMo RL's default block, the position means
  nothing and is accepted).
- ``lora_A_init``: ``xavier`` draws A from a Xavier normal, ``uniform`` from peft's own
  Kaiming uniform; B starts at zero either way, so a fresh adapter leaves the model as it was.
- ``use_triton`` is accepted for NeMo RL's block and changes nothing (peft's kernels run).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PEFT_INSTALL = "pip install 'sft-runtime[lora]'  (peft==0.21.2)"


class LoraConfig(BaseModel):
    """The adapters ``policy.dtensor_cfg.lora_cfg`` asks for (see the module docstring for each "
    "key)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    target_modules: list[str] = Field(default_factory=list)
    exclude_modules: list[str] = Field(default_factory=list)
    match_all_linear: bool = True
    dim: int = Field(8, ge=1)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    dropout_position: Literal["pre", "post"] = "post"
    lora_A_init: Literal["xavier", "uniform"] = "xavier"
    use_triton: bool = True

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        if self.target_modules and self.exclude_modules:
            raise ValueError(
                "policy.dtensor_cfg.lora_cfg.target_modules and "
                "policy.dtensor_cfg.lora_cfg.exclude_modules are exclusive: "
                "name the layers to adapt, or the ones to leave out, not both"
            )
        if self.target_modules and self.match_all_linear:
            raise ValueError(
                "policy.dtensor_cfg.lora_cfg.match_all_linear=true adapts every linear layer, "
                "overriding "
                "policy.dtensor_cfg.lora_cfg.target_modules (as in NeMo RL): set "
                "policy.dtensor_cfg.lora_cfg.match_all_linear=false to adapt only the modules named"
            )
        if not (self.match_all_linear or self.target_modules or self.exclude_modules):
            raise ValueError(
                "policy.dtensor_cfg.lora_cfg: nothing to adapt; set "
                "policy.dtensor_cfg.lora_cfg.match_all_linear=true or "
                "name policy.dtensor_cfg.lora_cfg.target_modules"
            )
        if self.dropout > 0 and self.dropout_position == "post":
            raise ValueError(
                "policy.dtensor_cfg.lora_cfg.dropout_position='post': peft applies LoRA dropout "
                "to the "
                "adapter's input only; set policy.dtensor_cfg.lora_cfg.dropout_position=pre (or "
                "dropout=0)"
            )
        return self

    @property
    def scaling(self) -> float:
        return self.alpha / self.dim
