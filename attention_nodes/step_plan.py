"""What one step runs, as the scheduler (attention_nodes/scheduler.py) plans it: each sequence's chunk of tokens
(`ScheduledSeq`) and the step's whole plan (`SchedulerOutput`), which the batch builders, the model and the
sampler read."""
from __future__ import annotations

from dataclasses import dataclass, field

from attention_nodes.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work this step: token_ids[start : start + num_new_tokens] go through the model."""

    seq: Sequence
    num_new_tokens: int
    start: int  # seq.num_computed_tokens when scheduled
    is_fork: bool = False  # a sample forked from another entry of this step: shares its forward, computes nothing
    # Speculative decoding: the drafts that follow the sequence's last token in this chunk (num_new_tokens is 1 +
    # their count; every row of the chunk is sampled). Taken from seq.spec_tokens when scheduled.
    drafts: list[int] = field(default_factory=list)
    # This chunk reaches the last known token, so its last forward row is sampled. Fixed when scheduled (the step
    # reads it several times per sequence; `Scheduler.update` then appends the sampled token to the seq).
    needs_sample: bool = field(init=False)

    def __post_init__(self) -> None:
        self.needs_sample = self.start + self.num_new_tokens - len(self.drafts) == len(self.seq.token_ids)

    @classmethod
    def from_seq(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        return cls(seq, num_new_tokens, seq.num_computed_tokens)

    def input_ids(self) -> list[int]:
        """The token ids this chunk runs: the sequence's, then its drafts."""
        end = self.start + self.num_new_tokens - len(self.drafts)
        return self.seq.token_ids[self.start:end] + self.drafts if self.drafts else self.seq.token_ids[self.start:end]


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs: `scheduled` (running first, then newly admitted) and who was preempted."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @classmethod
    def empty(cls) -> SchedulerOutput:
        return cls()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_decode(self) -> bool:
        """Every scheduled sequence computes one generated token (no prompt chunk), with its drafts if it has some;
        also when none is."""
        return all((s.num_new_tokens == 1 or s.drafts) and s.start >= s.seq.num_prompt_tokens for s in self.scheduled)
