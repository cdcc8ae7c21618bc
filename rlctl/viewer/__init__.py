"""The HTML report: one self-contained page (data, script and style embedded; no network) with every
logged metric and a rollout browser. :func:`write_html` builds it from :class:`rlctl.run_report.Run`s."""

from rlctl.viewer.page import write_html

__all__ = ["write_html"]
