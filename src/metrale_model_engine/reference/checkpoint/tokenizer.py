"""A checkpoint's ``tokenizer.json``, read with the ``tokenizers`` library (``Tokenizer``), and the shipped
model's own: one token per UTF-8 byte ([`byte_tokenizer`][metrale_model_engine.reference.checkpoint.byte_tokenizer]).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from .files import CheckpointError


class Tokenizer:
    """Text to token ids and back, as the checkpoint's ``tokenizer.json`` says.

    [`encode`][metrale_model_engine.reference.Tokenizer.encode] adds the special tokens the tokenizer's post-processor
    adds (a beginning-of-sequence token, say), as ``transformers`` does by default;
    [`decode`][metrale_model_engine.reference.Tokenizer.decode] leaves special tokens out of the text.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Read ``path`` (a ``tokenizer.json``).

        Raises:
            CheckpointError: the file cannot be read or is not a tokenizer.
        """
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as error:  # noqa: BLE001  (the library raises plain Exceptions for a bad file)
            raise CheckpointError(f"{path}: not a tokenizer the tokenizers library reads ({error})") from None

    @property
    def vocab_size(self) -> int:
        """The ids it knows, special tokens included."""
        size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        return size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, special tokens added as the tokenizer's post-processor says (unless
        ``add_special_tokens`` is false: a chat template's text holds its own)."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out (bytes that are not UTF-8 become U+FFFD)."""
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return text


def byte_tokenizer() -> tokenizers.Tokenizer:
    """A tokenizer whose id ``b`` is the byte ``b``: a byte-level BPE of 256 tokens and no merges.

    Each byte is first mapped to a printable character (the printable ASCII and
    Latin-1 bytes to themselves, the others to ``chr(256 + n)`` in order), as
    byte-level BPE tokenizers do, so its ``tokenizer.json`` is plain text.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    characters = {byte: chr(byte if byte in printable else next(shifted)) for byte in range(256)}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab={characters[byte]: byte for byte in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
