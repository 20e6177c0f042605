"""The router's answer to the requester: the request's one decision record, published on
the PrefillDone's `reply_to` when that is a requester's inbox (the decision is committed
before; a lost answer costs the requester a read of the DECISIONS stream, not the
decision)."""

from __future__ import annotations

import logging

from eldr.bus import Bus, BusError, is_reply_inbox
from eldr.wire import Decision, PrefillDone

from .metrics import RouterMetrics

log = logging.getLogger(__name__)

REPLY_PREFIXES = ("_INBOX",)
"""Requesters wait on inboxes: a PrefillDone.reply_to outside them is never answered (under
the generated permissions the server narrows it to the requester roles' own prefixes)."""


class Replies:
    """Answers requesters for one router replica."""

    def __init__(self, bus: Bus, metrics: RouterMetrics) -> None:
        self.bus = bus
        self.metrics = metrics

    async def answer(self, msg: PrefillDone, decision: Decision, *, already: bool) -> None:
        """Answer `msg`'s requester with `decision` (`already`: committed before, by this
        replica or another; counted and logged as such). Never raises."""
        if already:
            self.metrics.already_decided.inc()
            log.info(
                "request %s was already decided (worker %s); answering with that",
                msg.request_id,
                decision.worker_id,
            )
        if msg.reply_to and not is_reply_inbox(msg.reply_to, REPLY_PREFIXES):
            # The router publishes with its own rights, which include `decisions.*`: an
            # event naming another request's decision subject as its reply_to would have it
            # write a second, unchecked decision there (the stream records core publishes).
            log.warning(
                "request %s: reply_to %r is not an inbox (%s...): not answered",
                msg.request_id,
                msg.reply_to[:80],
                REPLY_PREFIXES[0],
            )
        elif msg.reply_to:
            try:
                await self.bus.publish(msg.reply_to, decision)
            except BusError as exc:  # the decision is committed; the requester can read it
                log.warning("could not answer %s for %s: %s", msg.reply_to, msg.request_id, exc)
