"""The rule catalogue. Codes are fixed (DESIGN.md); each rule is one module with its docs and examples."""
from __future__ import annotations

from synccheck.analyzer.rules.base import Rule
from synccheck.analyzer.rules.sc000 import ParseError
from synccheck.analyzer.rules.sc101 import SyncEveryMicrostep
from synccheck.analyzer.rules.sc102 import NoSyncMissesForward
from synccheck.analyzer.rules.sc103 import UnsyncedStep

ALL_RULES: tuple = (ParseError, SyncEveryMicrostep, NoSyncMissesForward, UnsyncedStep)
BY_CODE: dict = {rule.code: rule for rule in ALL_RULES}
BY_NAME: dict = {rule.name: rule for rule in ALL_RULES}

__all__ = ["ALL_RULES", "BY_CODE", "BY_NAME", "Rule"]
