"""``python -m adadsf_lab.study``: the study without the rest of the CLI."""

from adadsf_lab.study.command import main

raise SystemExit(main())
