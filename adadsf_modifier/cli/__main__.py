"""``python -m adadsf_modifier.cli``: the ``adadsf`` command."""

from adadsf_modifier.cli import main

raise SystemExit(main())
