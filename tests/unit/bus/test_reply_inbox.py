"""`eldr.bus.is_reply_inbox`: which subjects a service may answer when a message names one
(`PrefillDone.reply_to`), and the inbox prefixes settings accept."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from eldr.bus import is_reply_inbox
from eldr.settings import BusSettings

REQUESTERS = ("_INBOX.eldr.prefill", "_INBOX.eldr.simprefill")


@pytest.mark.parametrize(
    "subject",
    ["_INBOX.eldr.prefill.pw0.abc", "_INBOX.eldr.simprefill.prefill-0.x"],
)
def test_inboxes_under_an_allowed_prefix_are_answered(subject: str) -> None:
    assert is_reply_inbox(subject, REQUESTERS)


@pytest.mark.parametrize(
    "subject",
    [
        "",
        "_INBOX.eldr.prefill",  # the prefix itself is no inbox
        "_INBOX.eldr.prefillx.pw0.abc",  # a token that merely starts like it
        "_INBOX.eldr.router.abc",  # another role's inbox
        "_INBOX.eldr.prefill.*",
        "_INBOX.eldr.prefill.>",
        "_INBOX.eldr.prefill..abc",
        "_INBOX.eldr.prefill.a b",
        "eldr.decisions.abc",  # the confused-deputy case
        "_INBOX.eldr.prefill." + "x" * 600,
    ],
)
def test_anything_else_is_not(subject: str) -> None:
    assert not is_reply_inbox(subject, REQUESTERS)


def test_the_plain_prefix_accepts_every_inbox() -> None:
    assert is_reply_inbox("_INBOX.abc", ("_INBOX",))
    assert is_reply_inbox("_INBOX.eldr.prefill.pw0.abc", ("_INBOX",))
    assert not is_reply_inbox("_INBOXX.abc", ("_INBOX",))


def test_settings_accept_inbox_prefixes_only() -> None:
    assert BusSettings(inbox_prefix="_INBOX.eldr.router").inbox_prefix == "_INBOX.eldr.router"
    for bad in ("eldr.router", "_INBOX.>", "_INBOX.a.*", "_INBOX.", "_INBOX.a b"):
        with pytest.raises(ValidationError):
            BusSettings(inbox_prefix=bad)
