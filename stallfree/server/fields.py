"""String fields of the request bodies that must be text the tokenizer and the response's
UTF-8 can carry."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, StrictStr


def _encodable(text: str) -> str:
    # JSON may escape a lone UTF-16 surrogate ("\ud800"); Python decodes it into a str that
    # no UTF-8 encoder (the tokenizer's, the response's) accepts: refuse it here, by name.
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"must be valid Unicode text: a lone UTF-16 surrogate at "
                             f"character {exc.start} has no UTF-8 encoding") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_encodable)]
