"""LoRARequest: which adapter a request runs with, as vLLM spells it."""
from __future__ import annotations

import dataclasses
import numbers
import os


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, with a positive integer id unique to it and, unless it was added from
    memory (``LLM.add_lora``), the PEFT directory it is read from."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name: invalid value {self.lora_name!r}; valid: a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, numbers.Integral) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id: invalid value {self.lora_int_id!r}; valid: an integer >= 1")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest.lora_path: invalid value {self.lora_path!r}; valid: a PEFT adapter "
                             f"directory, or '' for an adapter added from memory")

    # vLLM's short names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
