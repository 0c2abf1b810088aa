"""A clock under the test's control, for the classes that take one (`clock=time.monotonic` in
production): the test moves `now` and the code under test reads it."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
