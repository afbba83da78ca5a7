"""Shared-prefix workloads: groups of prompts that start with the same system prompt.

Group g's prompts are ``system[g]`` (``system_len``, shared by the group) then a question
(``question_len``, unique per prompt), answered with ``output_len`` tokens.  Two ways of drawing them, as
the peers do:

* the fixed set (``fresh_questions=False``): ``num_groups x prompts_per_group`` prompts, shuffled once and
  then cycled, so whole prompts repeat once the set is exhausted (SGLang ``generated-shared-prefix``,
  vLLM ``prefix_repetition``, llm-d/inference-perf ``shared_prefix``);
* fresh questions (``fresh_questions=True``): each request takes a uniformly random group and a question
  never used before (AWS's 8k shared prefix, Dynamo's prefix-ratio benchmark).

The registry (``registry.py``) names one parameter class per peer workload, holding that peer's defaults.
"""

from __future__ import annotations

import numpy as np

from kvrouter.lab.workloads.arrivals import Arrival, Stage, Staged
from kvrouter.lab.workloads.build import GeneratorParams, Keys, Renderer, assemble, rng_for, schedule
from kvrouter.lab.workloads.spec import ClosedLoop, Request, Role, Segment, Workload


def _check_lengths(output_len: int, **lengths: int) -> None:
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1 (vLLM's max_tokens), got {output_len}")
    for name, value in lengths.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


class SharedPrefixParams(GeneratorParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Groups x prompts with a shared system prompt per group."""

    num_groups: int = 64
    """Distinct system prompts."""
    prompts_per_group: int = 16
    """Distinct questions per group (fixed set); ignored with ``fresh_questions``."""
    system_len: int = 2048
    """Tokens of each group's system prompt."""
    question_len: int = 128
    """Tokens of each question (the minimum, if ``question_len_max`` is set)."""
    question_len_max: int | None = None
    """If set, question lengths are uniform in ``[question_len, question_len_max]``."""
    output_len: int = 256
    """Tokens generated per request."""
    fresh_questions: bool = False
    """Every request gets a new question and a random group, instead of cycling the fixed set."""
    grouped: bool = False
    """The fixed set in group order (group 0's prompts, then group 1's, ...) instead of shuffled: with
    ``Bursts(size=prompts_per_group)`` each group arrives as one burst of a prefix nobody holds yet.
    The prompts are the same either way; only their order changes."""

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.prompts_per_group < 1:
            raise ValueError("num_groups and prompts_per_group must be >= 1")
        _check_lengths(self.output_len, system_len=self.system_len, question_len=self.question_len)
        if self.question_len_max is not None and self.question_len_max < self.question_len:
            raise ValueError("question_len_max must be >= question_len")
        if self.grouped and self.fresh_questions:
            raise ValueError("grouped orders the fixed set; fresh_questions draws no fixed set")


class SglangGspParams(SharedPrefixParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """SGLang ``bench_serving --dataset-name generated-shared-prefix`` defaults: 64 x 16, system 2048,
    question 128, output 256, every request at t=0 in shuffled order."""


class VllmPrefixRepetitionParams(SharedPrefixParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM ``bench serve --dataset-name prefix_repetition`` defaults: 10 prefixes of 256 tokens, suffixes
    of 256, output 128, 1000 prompts, shuffled, all at once (``--request-rate inf``)."""

    num_groups: int = 10
    prompts_per_group: int = 100
    system_len: int = 256
    question_len: int = 256
    output_len: int = 128


# The llm-d precise-prefix-cache guide's published inference-perf profile: a warm-up stage seating every
# group (15 x 50 = 750 = the whole prompt set), then a Poisson ladder from 3 to 60 QPS.
LLMD_PRECISE_STAGES = (
    Stage(15, 50), Stage(3, 20), Stage(10, 20), Stage(15, 20), Stage(20, 38), Stage(22, 34), Stage(25, 30),
    Stage(30, 25), Stage(35, 21), Stage(40, 38), Stage(43, 36), Stage(46, 33), Stage(49, 30), Stage(52, 29),
    Stage(55, 27), Stage(57, 26), Stage(60, 25),
)  # fmt: skip


class LlmdPreciseParams(SharedPrefixParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """llm-d precise-prefix-cache guide (their headline result): 150 x 5, system 6000, question 1200,
    output 1000, the prompt set shuffled once and cycled, Poisson 3 -> 60 QPS in stages (8 instances)."""

    num_groups: int = 150
    prompts_per_group: int = 5
    system_len: int = 6000
    question_len: int = 1200
    output_len: int = 1000
    arrival: Arrival = Staged(LLMD_PRECISE_STAGES, poisson=True)


class LlmdSharedPrefixParams(SharedPrefixParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """llm-d-benchmark ``shared_prefix_synthetic`` profile: 32 x 32, 2048 / 256 / 256, constant 2, 5, 8,
    10, 12, 15, 20 QPS for 50 s each."""

    num_groups: int = 32
    prompts_per_group: int = 32
    system_len: int = 2048
    question_len: int = 256
    output_len: int = 256
    arrival: Arrival = Staged(tuple(Stage(r, 50) for r in (2, 5, 8, 10, 12, 15, 20)), poisson=False)


class LlmdTieredParams(SharedPrefixParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """llm-d tiered-prefix-cache guide: 250 x 5, 16000 / 256 / 256, Poisson 5, 10, 20, 40 QPS for 60 s
    each (a working set meant to overflow GPU memory into CPU offload)."""

    num_groups: int = 250
    prompts_per_group: int = 5
    system_len: int = 16000
    question_len: int = 256
    output_len: int = 256
    arrival: Arrival = Staged(tuple(Stage(r, 60) for r in (5, 10, 20, 40)), poisson=True)


class Aws8kParams(SharedPrefixParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """AWS SageMaker PREFIX_AWARE test: one 8,000-token common prefix, varied questions, for an hour
    (their fleet: 7 instances of Llama 3.1 70B; question and output lengths and the rate are not
    published: ours are typical)."""

    num_groups: int = 1
    system_len: int = 8000
    question_len: int = 100
    question_len_max: int | None = 300
    output_len: int = 200
    fresh_questions: bool = True
    arrival: Arrival = Staged((Stage(2.0, 3600),), poisson=True)


class DynamoPrefixRatioParams(GeneratorParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """NVIDIA Dynamo router ``prefix_ratio`` benchmark: ``num_prefixes`` shared prefixes of
    ``prefix_ratio * input_len`` tokens, each request a random prefix plus a fresh suffix, closed loop."""

    input_len: int = 14_000
    """Prompt tokens (prefix + suffix)."""
    output_len: int = 200
    """Tokens generated per request."""
    num_prefixes: int = 20
    """Distinct prefixes."""
    prefix_ratio: float = 0.5
    """Fraction of the prompt that is the shared prefix (their sweep: 0.1 .. 0.9)."""
    num_requests: int | None = 200
    arrival: Arrival = ClosedLoop(20)

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefix_ratio <= 1.0:
            raise ValueError(f"prefix_ratio must be in [0, 1], got {self.prefix_ratio}")
        if self.num_prefixes < 1:
            raise ValueError("num_prefixes must be >= 1")
        _check_lengths(self.output_len, input_len=self.input_len)


def shared_prefix(
    name: str,
    params: SharedPrefixParams,
    recorded: GeneratorParams | None = None,
) -> Workload:
    """Build a groups x prompts workload (see the module docstring for the two drawing modes).

    ``recorded``: the parameters to store in the metadata, when ``params`` was derived from others."""
    times = schedule(params, params.num_groups * params.prompts_per_group)
    n = len(times)
    rng = rng_for(params, "prompts")
    keys = Keys(params.seed, name)
    render = Renderer(params.form)
    q_lo = params.question_len
    q_hi = q_lo if params.question_len_max is None else params.question_len_max
    if params.fresh_questions:
        groups = rng.integers(0, params.num_groups, n).tolist()
        slots = list(range(n))
        q_lens = rng.integers(q_lo, q_hi + 1, n).tolist()
    else:
        size = params.num_groups * params.prompts_per_group
        perm = rng.permutation(size)  # drawn either way, so grouped and shuffled sets hold the same prompts
        if params.grouped:
            perm = np.arange(size)
        order = perm[np.arange(n) % size] if n else np.zeros(0, dtype=np.int64)
        groups = (order // params.prompts_per_group).tolist()
        slots = (order % params.prompts_per_group).tolist()
        # A question's length belongs to the question, so a repeated prompt is token-identical.
        table = rng.integers(q_lo, q_hi + 1, (params.num_groups, params.prompts_per_group))
        q_lens = table[groups, slots].tolist() if n else []
    requests = []
    for i, (t, g, slot, q_len) in enumerate(zip(times, groups, slots, q_lens)):
        parts: list[tuple[Role, Segment]] = [
            ("system", keys.segment(params.system_len, "system", g)),
            ("user", keys.segment(q_len, "question", g, slot)),
        ]
        requests.append(
            Request(
                id=f"{name}-{i:06d}",
                arrival_s=t,
                max_output_tokens=params.output_len,
                group=f"g{g:03d}",
                **render.fields(parts),
            )
        )
    return assemble(name, recorded or params, requests)


def dynamo_prefix_ratio(name: str, params: DynamoPrefixRatioParams) -> Workload:
    """Dynamo's prefix-ratio benchmark as a fresh-question shared-prefix workload."""
    prefix = round(params.input_len * params.prefix_ratio)
    shaped = SharedPrefixParams(
        seed=params.seed,
        form=params.form,
        token_space=params.token_space,
        num_requests=params.num_requests,
        arrival=params.arrival,
        num_groups=params.num_prefixes,
        system_len=prefix,
        question_len=params.input_len - prefix,
        output_len=params.output_len,
        fresh_questions=True,
    )
    return shared_prefix(name, shaped, recorded=params)
