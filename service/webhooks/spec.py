"""What a request asks for: `webhook: {"url": ..., "events": [...]}`, and the event names sent.

Event types are `job.<what happened>`: `job.succeeded`, `job.failed`, `job.cancelled` (the issue's and Standard
Webhooks' examples' spelling; `job.canceled`, the job status's spelling, is accepted as a subscription too) and
`job.expired`. Only a job's end is an event: one delivery per job, so its `webhook-id` is the job's.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from meshserve.service.contract import JobStatus

# The event type sent for each terminal status.
EVENT_TYPES: dict[JobStatus, str] = {
    JobStatus.SUCCEEDED: "job.succeeded",
    JobStatus.FAILED: "job.failed",
    JobStatus.CANCELED: "job.cancelled",
    JobStatus.EXPIRED: "job.expired",
}
# What a request may list in `events` -> the status it fires on.
SUBSCRIBABLE: dict[str, JobStatus] = {
    **{name: status for status, name in EVENT_TYPES.items()},
    "job.canceled": JobStatus.CANCELED,
}
# URLs are bounded like every string a client sends.
MAX_URL_LENGTH = 2048


class WebhookRequest(BaseModel):
    """The request's `webhook` field. `events` left out: every terminal event."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=1,
        max_length=MAX_URL_LENGTH,
        description="An http(s) URL resolving to a public address (no loopback, private, link-local or reserved "
        "address, checked now and again at each delivery; redirects are not followed).",
    )
    events: list[str] | None = Field(
        None,
        min_length=1,
        max_length=len(SUBSCRIBABLE),
        description="Which ends to POST: any of "
        + ", ".join(f"`{e}`" for e in SUBSCRIBABLE)
        + " (default: all).",
    )

    @field_validator("events")
    @classmethod
    def _known_events(cls, events: list[str] | None) -> list[str] | None:
        for event in events or []:
            if event not in SUBSCRIBABLE:
                raise ValueError(f"unknown event {event!r}; one of {', '.join(SUBSCRIBABLE)}")
        return events

    def statuses(self) -> list[JobStatus]:
        """The terminal statuses it fires on, in the enum's order."""
        wanted = {SUBSCRIBABLE[e] for e in self.events} if self.events else set(EVENT_TYPES)
        return [s for s in EVENT_TYPES if s in wanted]


class WebhookSpec(BaseModel):
    """What the job hash keeps (`webhook`): where to POST, which statuses, and whose secret signs it (the
    submitting API key's SHA-256, as `service/auth.py` indexes keys; "" in open mode: `webhook_secret`)."""

    model_config = ConfigDict(frozen=True)

    url: str
    statuses: list[JobStatus]
    key: str = ""

    def fires_on(self) -> str:
        """The statuses as the `finish` script matches them: space-separated and padded."""
        return " " + " ".join(s.value for s in self.statuses) + " "
