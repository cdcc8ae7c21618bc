"""The real torch.distributed.checkpoint fixtures of test_damage.py, for the other fault tests too."""

from tests.faults.test_damage import pristine, run  # noqa: F401
