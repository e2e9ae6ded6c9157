"""`planc codes [CODE]`: every diagnostic code, or one explained."""

from __future__ import annotations

from planc.cli.common import EXIT_OK, UsageError
from planc.diagnostics import CODES


def cmd_codes(args) -> int:
    if args.code:
        code = args.code.upper()
        if code not in CODES:
            raise UsageError(f"no diagnostic code {args.code}")
        c = CODES[code]
        print(f"{code} ({c.severity}): {c.title}\n\n{c.explanation}")
        return EXIT_OK
    for code, c in CODES.items():
        print(f"{code}  {c.severity:<7}  {c.title}")
    return EXIT_OK
