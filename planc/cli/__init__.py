"""The `planc` command line (`planc.cli.main:main`); one module per command."""

from planc.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, ModelCache, UsageError, compile_for_cli, use_color
from planc.cli.main import build_parser, main

__all__ = ["EXIT_ERRORS", "EXIT_OK", "EXIT_USAGE", "ModelCache", "UsageError", "build_parser", "compile_for_cli",
           "main", "use_color"]
