"""Rule tables (issue 53): a test module's rows are (id, inputs..., expected), the id naming the
corpus run or measurement the row stands for; `cases` and `ids` feed them to
pytest.mark.parametrize, and `Range` is an expected value that is a bound."""
from __future__ import annotations

import math


class Range:
    """An expected value that is a bound: lo <= value <= hi (lo < value < hi where `open`)."""

    def __init__(self, lo: float = -math.inf, hi: float = math.inf, open: bool = False) -> None:
        self.lo, self.hi, self.open = lo, hi, open

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (int, float)):
            return False
        return self.lo < other < self.hi if self.open else self.lo <= other <= self.hi

    def __repr__(self) -> str:
        return f"Range({self.lo}, {self.hi}{', open' if self.open else ''})"


def cases(rows: list[tuple]) -> list[tuple]:
    """The rows without their ids."""
    return [row[1:] for row in rows]


def ids(rows: list[tuple]) -> list[str]:
    return [row[0] for row in rows]
