"""What shoal calls of a Hugging Face fast tokenizer, as a Protocol.

`load_tokenizer` (loading/loader.py) returns a transformers `PreTrainedTokenizerFast`, which
fits. A Protocol rather than transformers' own type: transformers is imported by name at run
time (~1 s), and mypy, run from the repository root, would follow its optional
`import kernels` into shoal's own kernels/ package (docs/architecture.md, "Where the code
moved past the brief", point 11). The attributes a caller only probes for, with `getattr`
(`backend_tokenizer`, `clean_up_tokenization_spaces`: actors/tokenizer/detokenize.py,
api/http/openai_logprobs.py), are not part of it. Checkable at run time (isinstance), for
tests/actors/test_refusals.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class HFTokenizer(Protocol):
    def encode(self, text: str, /, add_special_tokens: bool = ...) -> list[int]:
        """The text's token ids (special tokens added as the model's tokenizer does)."""
        ...

    def decode(self, token_ids: Sequence[int], /, skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        /,
        *,
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
        **kwargs: Any,
    ) -> str | list[int]:
        """The model's chat template over the messages: text with tokenize=False; `tools` and
        any template variable as keywords."""
        ...

    def convert_ids_to_tokens(self, ids: int, /) -> str | list[str]:
        """A token id's piece as the vocabulary spells it."""
        ...
