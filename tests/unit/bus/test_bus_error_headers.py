"""A service's error answer is read from the NATS service protocol's headers (`nats.micro`),
and from the bus's older pair, which a service of the previous release still sends."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from eldr.bus import RemoteError
from eldr.bus.publishing import LEGACY_ERROR_HEADERS, raise_remote_error


def _answer(headers: dict[str, str] | None, data: bytes = b"") -> Msg:
    client: Any = None  # never used: the answer is only read
    return Msg(client, subject="_INBOX.test", data=data, headers=headers)


@pytest.mark.parametrize(
    ("text_header", "code_header"), [(ERROR_HEADER, ERROR_CODE_HEADER), LEGACY_ERROR_HEADERS]
)
def test_an_error_answer_raises_its_code_and_description(
    text_header: str, code_header: str
) -> None:
    with pytest.raises(RemoteError) as info:
        raise_remote_error(_answer({text_header: "inconsistent: no", code_header: "403"}))
    assert (info.value.code, info.value.message) == (403, "inconsistent: no")


def test_an_error_answer_without_a_numeric_code_is_a_500() -> None:
    with pytest.raises(RemoteError) as info:
        raise_remote_error(_answer({ERROR_HEADER: "boom", ERROR_CODE_HEADER: "bad"}))
    assert info.value.code == 500


@pytest.mark.parametrize("headers", [None, {}, {"Other": "x"}])
def test_a_reply_without_error_headers_is_not_an_error(headers: dict[str, str] | None) -> None:
    raise_remote_error(_answer(headers, data=b"\x01"))
