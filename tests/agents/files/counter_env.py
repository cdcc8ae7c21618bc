"""A TRL-style environment (environment_factory convention): reset(**row), public methods are tools."""


class CounterEnv:
    def __init__(self):
        self.total = 0
        self.target = None

    def reset(self, target: int, **kwargs) -> str:
        self.total = 0
        self.target = target
        return f"Reach exactly {target}."

    def increment(self, step: int) -> str:
        """Add a step to the counter.

        Args:
            step: How much to add.
        """
        self.total += step
        return f"total={self.total}"

    def read(self) -> int:
        """Read the counter."""
        return self.total

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0

    def _internal(self):
        pass


class HangingEnv:
    """An environment whose ``wait`` method never returns in time."""

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def wait(self, seconds: float) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        import time

        self.calls += 1
        time.sleep(seconds)
        return "done"
