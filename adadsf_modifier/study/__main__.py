"""``python -m adadsf_modifier.study``: the study without the rest of the CLI."""

from adadsf_modifier.study.command import main

raise SystemExit(main())
