"""The precision ladder of ``opt_level="auto"``: the rungs and the rules that move down them
(:mod:`.rules`), the snapshots a move rolls back to (:mod:`.snapshot`) and the ladder that moves
(:mod:`.ladder`), all framework-free; :class:`~lightning_amp.amp.runtime.AmpRuntime` drives it."""
from lightning_amp.amp.ladder.ladder import AmpLadder
from lightning_amp.amp.ladder.rules import LadderRules

__all__ = ["AmpLadder", "LadderRules"]
