"""``python -m rlctl.catalog > docs/catalog.md`` regenerates the catalog page."""

from . import catalog_markdown

print(catalog_markdown(), end="")
