"""Tool functions as a TRL user writes them (type hints, Google-style docstrings)."""

import asyncio
import time
from typing import Literal


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def power(base: int, exponent: int = 2, mode: Literal["exact", "float"] = "exact") -> str:
    """Raise a number to a power.

    Args:
        base: The base.
        exponent: The exponent.
        mode: Whether to return an exact integer or a float.
    """
    value = base**exponent
    return str(float(value) if mode == "float" else value)


def lookup(names: list[str], table: dict[str, int] | None = None) -> dict:
    """Look names up.

    Args:
        names: The names to look up.
        table: Optional values by name.
    """
    table = table or {}
    return {n: table.get(n, len(n)) for n in names}


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


async def async_echo(text: str) -> str:
    """Echo text after an await.

    Args:
        text: The text.
    """
    await asyncio.sleep(0.01)
    return text.upper()


def _private_helper() -> None:
    pass


async def async_sleepy(seconds: float) -> str:
    """Await a sleep.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return "awake"
