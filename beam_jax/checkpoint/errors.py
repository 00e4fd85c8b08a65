"""The one error a checkpoint load raises when files and config disagree."""

from __future__ import annotations

from collections.abc import Sequence


class CheckpointError(ValueError):
    """A checkpoint does not match what the config expects, or is not a valid file.

    `problems` holds one line per problem (`name: expected ..., found ...`), so callers and tests
    can inspect them; the message lists all of them, because fixing a checkpoint one error per
    attempt is slow when each attempt reads headers of hundreds of shards.
    """

    def __init__(self, summary: str, problems: Sequence[str] = ()):
        self.summary = summary
        self.problems = tuple(problems)
        lines = [summary] + [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))
