"""What every counter record shares: its declared fields, spans, and a JSON form.

streaming_ext/_declared.py (generated from moeflash_stream.h's MF_STATS_FIELDS) defines the
record itself, StreamerStats, on this base; nothing here names a counter, so a counter added in C
reaches every reader of the record without a Python edit.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from streaming_ext.declarations import Stat


class StatsRecord:
    """A counter record (a frozen dataclass of ints, one per declared counter)."""

    @classmethod
    def declared(cls) -> tuple[Stat, ...]:
        """The counters, as declared in C (the subclass's)."""
        raise NotImplementedError

    def as_dict(self) -> dict[str, int]:
        """The counters under their C names, in their C order."""
        return {s.name: int(getattr(self, s.name)) for s in self.declared()}

    def __sub__(self, before: Self) -> Self:
        """The span from `before` to this record: counters as differences, gauges as they are now."""
        values = {
            s.name: getattr(self, s.name) - (getattr(before, s.name) if s.kind == "COUNTER" else 0)
            for s in self.declared()
        }
        return dataclasses.replace(self, **values)  # type: ignore[type-var]

    def __add__(self, later: Self) -> Self:
        """Two consecutive spans as one: counters summed, gauges as at the end of `later`."""
        values = {
            s.name: getattr(later, s.name) + (getattr(self, s.name) if s.kind == "COUNTER" else 0)
            for s in self.declared()
        }
        return dataclasses.replace(self, **values)  # type: ignore[type-var]

    def share(self, part: int, whole: int) -> Self:
        """`part` of `whole` tokens' share of a span: counters scaled (rounded down), gauges as they
        are. The shares of a step's requests sum to the step, less the rounding."""
        values = {
            s.name: getattr(self, s.name) * part // whole if s.kind == "COUNTER" else getattr(self, s.name)
            for s in self.declared()
        }
        return dataclasses.replace(self, **values)  # type: ignore[type-var]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        """A record from as_dict()'s output (a counter it lacks is 0: an older report)."""
        return cls(**{s.name: int(values.get(s.name) or 0) for s in cls.declared()})
