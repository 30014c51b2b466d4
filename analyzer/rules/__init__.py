"""The rule catalogue. Codes are fixed (DESIGN.md); each rule is one module with its docs and examples."""
from __future__ import annotations

from synccheck.analyzer.rules.base import Rule
from synccheck.analyzer.rules.sc000 import ParseError
from synccheck.analyzer.rules.sc101 import SyncEveryMicrostep
from synccheck.analyzer.rules.sc102 import NoSyncMissesForward
from synccheck.analyzer.rules.sc103 import UnsyncedStep
from synccheck.analyzer.rules.sc104 import NoSyncOnUnwrapped
from synccheck.analyzer.rules.sc105 import AccumulateWithoutSteps
from synccheck.analyzer.rules.sc106 import StaticGraphNoSync
from synccheck.analyzer.rules.sc201 import ZeroGradEveryMicrostep
from synccheck.analyzer.rules.sc202 import UnscaledAccumulatedLoss
from synccheck.analyzer.rules.sc301 import CollectiveInRankBranch
from synccheck.analyzer.rules.sc302 import SamplerWithoutSetEpoch

ALL_RULES: tuple = (ParseError, SyncEveryMicrostep, NoSyncMissesForward, UnsyncedStep, NoSyncOnUnwrapped,
                    AccumulateWithoutSteps, StaticGraphNoSync, ZeroGradEveryMicrostep, UnscaledAccumulatedLoss,
                    CollectiveInRankBranch, SamplerWithoutSetEpoch)
BY_CODE: dict = {rule.code: rule for rule in ALL_RULES}
BY_NAME: dict = {rule.name: rule for rule in ALL_RULES}

__all__ = ["ALL_RULES", "BY_CODE", "BY_NAME", "Rule"]
