"""``python -m prefixcache``: the same command line as the ``prefixcache`` console script."""

from __future__ import annotations

from prefixcache.engine.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
