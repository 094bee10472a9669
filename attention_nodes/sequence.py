"""One request's tokens, KV bookkeeping and finish state, as the scheduler sees it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from attention_nodes.sampling_params import SamplingParams


def sample_ids(request_id: str, num_samples: int) -> list[str]:
    """The ids the engine reports a request's samples under: the request's own id for one sample, else
    f"{request_id}#{index}" each."""
    return [request_id] if num_samples == 1 else [f"{request_id}#{i}" for i in range(num_samples)]


def request_of(row_id: str) -> str:
    """The request id a sample id belongs to (a request's own id is its own)."""
    return split_sample_id(row_id)[0]


def split_sample_id(row_id: str) -> tuple[str, int]:
    """(request id, sample index) of a sample id; a request's own id is its sample 0."""
    rid, sep, index = row_id.rpartition("#")
    return (rid, int(index)) if sep else (row_id, 0)


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


def seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A seeded request's own random stream, on the device its logits are sampled on (a CPU generator cannot
    draw into a CUDA tensor)."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(slots=True, eq=False)  # eq=False: identity semantics, so list.remove never hits a look-alike
class Sequence:
    """A request's prompt plus generated tokens.

    token_ids: prompt followed by generated tokens.
    arrival: monotonic admission number; the largest running arrival is preempted first (scheduling_policy
        "fcfs"; under "priority" the largest (params.priority, arrival)).
    num_computed_tokens: prefix of token_ids whose KV is in the cache (reset to 0 on preemption).
    block_table: KV block ids covering token_ids[i] at block_table[i // block_size].
    finish_reason: "stop", "length" or "abort" once finished.
    generator: per-request RNG, set when params.seed is not None.
    prompt_logprobs: with params.prompt_logprobs set, one entry per prompt token computed so far: ({token id:
        log-probability} holding the prompt token and the top alternatives, the prompt token's rank); None for the
        first token.
    num_prompt_logprobs_sent: how many of those entries the worker has reported.
    block_keys: prefix-cache keys of the full blocks of token_ids computed so far (a cache: tokens only grow).
    num_registered_blocks: how many leading blocks of block_table are findable in the prefix cache.
    block_table_version: counts the changes to block_table other than appending (`replace_blocks`,
        `replace_block`): the rank's InputBatch rewrites its copy of the table when it moves, else appends.
    spec_tokens: speculative decoding's drafts for this sequence's next step (attention_nodes/speculation.py);
        not part of token_ids until verified.
    token_array: the drafter's numpy copy of token_ids, appended to as they grow (None until it first proposes).
    draft_computed: the leading positions whose KV the draft model holds (attention_nodes/draft_model.py).
    allowed_ids: params.allowed_token_ids within the vocabulary as a device tensor, built on its first draw
        (attention_nodes/logits_process.py), so a step does not rebuild it from the list.
    group_id: for a request drawing several samples (SamplingParams.num_samples > 1), the request's own id; each
        sample's request_id is then f"{group_id}#{sample_index}". None otherwise.
    forked: the samples exist (set on all of them once the first sample is drawn).
    num_cached_tokens: the prompt tokens found in the prefix cache (device or host tier) when the sequence was
        first admitted, which it did not compute (vLLM's RequestOutput.num_cached_tokens; 0 with caching off);
        None until then. A recompute after preemption does not change it.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    prompt_logprobs: list[tuple[dict[int, float], int] | None] | None = None
    num_prompt_logprobs_sent: int = 0
    block_keys: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    group_id: str | None = None
    sample_index: int = 0
    forked: bool = False
    block_table_version: int = 0
    spec_tokens: list[int] = field(default_factory=list)
    token_array: object = None
    draft_computed: int = 0
    allowed_ids: torch.Tensor | None = None
    grammar: object = None      # structured outputs: its xgrammar matcher on this rank, once made (structured.py)
    compiling: bool = False     # its grammar compiles on this rank's grammar thread: not scheduled until it has
    num_cached_tokens: int | None = None

    @classmethod
    def from_request(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     arrival: int, device: torch.device | str = "cpu") -> Sequence:
        """device: where the rank samples (a seeded request's generator must live there)."""
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt: pass at least one token id")
        generator = None if params.seed is None else seeded_generator(params.seed, device)
        group = request_id if params.num_samples > 1 else None
        return cls(request_id=request_id if group is None else f"{group}#0", token_ids=list(prompt_token_ids),
                   num_prompt_tokens=len(prompt_token_ids), params=params, arrival=arrival,
                   generator=generator, prompt_logprobs=None if params.prompt_logprobs is None else [None],
                   group_id=group)

    @classmethod
    def resumed(cls, request_id: str, index: int, prompt_token_ids: list[int], output_ids: list[int],
                params: SamplingParams, arrival: int, device: torch.device | str = "cpu") -> Sequence:
        """Sample `index` of a request moved from a lost attention rank with output_ids generated so far (its
        KV is recomputed like a preempted sequence's). A seeded sample restarts its generator from the seed
        and the tokens so far, so it is reproducible but not the stream it would have drawn unmoved."""
        group = request_id if params.num_samples > 1 else None
        generator = None
        if params.seed is not None:
            generator = seeded_generator((params.seed + index + 1000003 * len(output_ids)) % 2**63, device)
        return cls(request_id=request_id if group is None else f"{group}#{index}",
                   token_ids=list(prompt_token_ids) + list(output_ids), num_prompt_tokens=len(prompt_token_ids),
                   params=params, arrival=arrival, generator=generator,
                   prompt_logprobs=None if params.prompt_logprobs is None else [None], group_id=group,
                   sample_index=index, forked=group is not None)

    def replace_blocks(self, blocks: list[int]) -> None:
        """A new block table (admission from the prefix cache, release, a handover)."""
        self.block_table = blocks
        self.block_table_version += 1

    def replace_block(self, index: int, block: int) -> None:
        """Block `index` of the table becomes `block` (copy on write)."""
        self.block_table[index] = block
        self.block_table_version += 1

    @property
    def needs_fork(self) -> bool:
        """The next sample drawn for this sequence is its first: draw one per sample and fork."""
        return self.group_id is not None and not self.forked

    def fork(self, index: int, generator: torch.Generator | None) -> Sequence:
        """Sample `index` of this request, in this sequence's state before its first sample: the same tokens,
        computed prefix and blocks (the caller takes a reference on each) and arrival."""
        assert self.needs_fork and self.num_output_tokens == 0, f"fork of {self.request_id!r} after its first token"
        return Sequence(request_id=f"{self.group_id}#{index}", token_ids=list(self.token_ids),
                        num_prompt_tokens=self.num_prompt_tokens, params=self.params, arrival=self.arrival,
                        num_computed_tokens=self.num_computed_tokens, block_table=list(self.block_table),
                        status=self.status, generator=generator, block_keys=list(self.block_keys),
                        num_registered_blocks=self.num_registered_blocks, group_id=self.group_id,
                        sample_index=index, forked=True, num_cached_tokens=self.num_cached_tokens)

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Of a forward over positions [start, end), those whose logits score a prompt token not yet scored
        (position p scores token p + 1). Empty unless prompt logprobs were asked for; a chunk recomputed after
        preemption scores nothing twice."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, self.num_prompt_tokens - 1))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prefilled(self) -> bool:
        """Its prompt (and any tokens it resumed with) is computed and a token was drawn after it: all that is
        left is decoding (PD: the point where a prefill rank hands it to a decode rank)."""
        return 0 < self.num_computed_tokens == self.num_tokens - 1 and self.num_tokens > self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, eos_token_ids: frozenset[int], max_model_len: int) -> str | None:
        """Append a sampled token; return "stop"/"length" and mark FINISHED if generation ends, else None.

        Stop conditions are checked before length ones, so a stop token that also
        hits max_tokens reports "stop".
        """
        assert not self.is_finished, f"append_token on finished request {self.request_id!r}"
        self.token_ids.append(token_id)
        reason = None
        if token_id in self.params.stop_token_ids or token_id in eos_token_ids and not self.params.ignore_eos:
            reason = "stop"
        elif self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            reason = "length"
        if reason is not None:
            self.status = SequenceStatus.FINISHED
            self.finish_reason = reason
        return reason
