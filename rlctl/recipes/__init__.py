"""The rank side of each method: ``python -m rlctl.recipes.<sft|grpo|ppo> --run-dir RUN`` under torchrun."""

import sys

if sys.argv[:1] == ["-m"]:  # started as `python -m rlctl.recipes.<method>` (argv[0] is "-m" while it is found)
    from rlctl.runtime.signals import install_early

    install_early()  # a Ctrl-C while torch and the engines import is a stop request, not a traceback
