"""A numeric field's bounds, written on the field itself (as pydantic's `Field(ge=...)`):
read by config/validate.py (check_bounds refuses a value outside them, naming the field)
and by config/load.py's help text (which prints them), so both say the same thing.

    steps: int = bounded(100, ge=1, le=MAX_STEPS)      # config/schema.py
    bound_of(dataclasses.fields(RunConfig)[1])        # Bound(lo=1, hi=1000000000)

A tuple or list field's bound holds for each element (`trainer.betas[0]`). Pure: no imports
beyond the standard library.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flexmarl_hpc.config.errors import ConfigError

BOUND = "bound"
"""The field metadata key holding its Bound."""
MAX_STEPS = 10**9
"""run.steps above this cannot be meant (and step numbers must fit the store's int64)."""
MAX_STARTUP_S = 86400.0
"""A start-up phase's deadline is at most a day (a typo of minutes for seconds is refused)."""
SIGNAL_MAX_S = 65535
"""slurm.signal_seconds: `sbatch --signal=SIG@N` takes N up to 65535."""


@dataclass(frozen=True)
class Bound:
    lo: float
    """The least value (or, with lo_open, the value it must exceed)."""
    hi: float | None = None
    """The largest value (None: unbounded above)."""
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""
    """Appended to the range in messages and help, e.g. ' (0: by minutes only)'."""

    def text(self, integer: bool) -> str:
        """`>= 1`, `1..16` (integers); `> 0`, `0 < x <= 1` (floats)."""
        if integer:
            return (f">= {self.lo}" if self.hi is None else f"{self.lo}..{self.hi}") + self.note
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}{self.note}"
        return (f"{self.lo:g} {'<' if self.lo_open else '<='} x {'<' if self.hi_open else '<='} "
                f"{self.hi:g}{self.note}")

    def holds(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and (self.hi is None or (value < self.hi if self.hi_open else value <= self.hi))

    def check(self, value: float, where: str) -> None:
        """ConfigError `where: expected RANGE, got VALUE` unless `value` is inside."""
        if not self.holds(value):
            integer = isinstance(value, int)
            raise ConfigError(f"{where}: expected {self.text(integer)}, got {value if integer else repr(value)}")


def bounded(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, note: str = "",
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with `default` (or `default_factory`) and its bounds: ge/gt the lower
    (inclusive/exclusive), le/lt the upper; `note` says what a special value means."""
    if (ge is None) == (gt is None):
        raise ValueError("bounded: give exactly one of ge, gt")
    bound = Bound(ge if gt is None else gt, lt if le is None else le, gt is not None, lt is not None, note)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={BOUND: bound})


def bound_of(f: dataclasses.Field) -> Bound | None:
    return f.metadata.get(BOUND)
