"""The ``multi_turn`` rollout function: generate, parse tool calls, step the environment, append the
observation, repeat, token in and token out.

Each policy turn keeps the engine's tokens, log-probs and weight version (loss mask 1). Each
observation is the chat template's suffix for the new messages (:class:`Conversation`), appended with
loss mask 0 and log-prob 0.0. A trajectory ends when the env says done (COMPLETED), or at
``max_turns``, ``max_total_tokens`` or the context length (TRUNCATED, the reason names which).
A trajectory aborted by a partial rollout keeps its env and continues from its exact tokens.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from miles.agentic.chat import Conversation, NotAppendOnly, first_differing_token, normalize_messages
from miles.agentic.metrics import TITO_STATS, TOOL_STATS
from miles.agentic.turns import read_turn
from miles.agentic.types import Action, EnvContext, ToolResult
from miles.rollout.context import RolloutContext
from miles.types import Sample, SampleStatus

__all__ = ["MultiTurn"]

_PER_TURN = "rollout.sampling.max_new_tokens"


def _cut_reason(turn: int, limit: str) -> str:
    return f"turn {turn} cut at {limit}" if limit.startswith(_PER_TURN) else limit


@dataclass
class _Trajectory:
    env: Any
    env_ctx: EnvContext
    conversation: Conversation | None = None  # set by MultiTurn._start
    tools: list[dict[str, Any]] = field(default_factory=list)  # the env's schemas, for checking calls
    turn_start: int = 0  # where the current policy turn begins in response_ids
    closed: bool = field(default=False, repr=False)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                await self.env.close()
            finally:
                await self.env_ctx.close()


class MultiTurn:
    """Registered as rollout function ``multi_turn``; needs ``rollout.env``.

    ``max_turns``: policy turns per trajectory; ``max_total_tokens``: response tokens (observations
    included) per trajectory, 0 for the context length only; ``tools_in_prompt``: render the env's tool
    schemas into the prompt with the chat template (off for a small model that learned the format).
    The per-turn limit is ``rollout.sampling.max_new_tokens``; ``on_cut_turn``: what a turn cut by it does:
    ``env`` steps the env with it (``Action.cut`` is true), which ends the trajectory or answers and goes on;
    ``end`` ends the trajectory there. Either way the sample is TRUNCATED, its reason names the turn.
    """

    def __init__(self, max_turns: int = 8, max_total_tokens: int = 0, tools_in_prompt: bool = True,
                 on_cut_turn: str = "env") -> None:
        if max_turns < 1 or max_total_tokens < 0:
            raise ValueError(f"max_turns must be >= 1 and max_total_tokens >= 0, got {max_turns}, {max_total_tokens}")
        if on_cut_turn not in ("env", "end"):
            raise ValueError(f"on_cut_turn must be 'env' or 'end', got {on_cut_turn!r}")
        self.max_turns, self.max_total_tokens, self.tools_in_prompt = max_turns, max_total_tokens, tools_in_prompt
        self.on_cut_turn = on_cut_turn
        self._suspended: dict[str, _Trajectory] = {}  # aborted trajectories, continued in a later step

    async def __call__(self, sample: Sample, ctx: RolloutContext) -> Sample:
        if ctx.env is None:
            raise ValueError("multi_turn needs an environment: set rollout.env (e.g. {name: tool_env})")
        key = sample.metadata.setdefault("trajectory", uuid.uuid4().hex)
        trajectory = self._suspended.pop(key, None)
        if trajectory is None and sample.response_ids:
            sample.fail("rollout: this aborted trajectory's environment is gone (the run restarted since); "
                        "multi-turn partial rollouts continue within one run")
            return sample
        keep = False
        try:
            if trajectory is None:
                env_ctx = EnvContext(ctx.sandbox, ctx.tool, ctx.seed, max_turns=self.max_turns)
                try:
                    trajectory = _Trajectory(ctx.env(env_ctx), env_ctx)
                except BaseException:
                    await env_ctx.close()  # the factory may have opened the sandbox already
                    raise
                await self._start(trajectory, sample, ctx)
            else:
                sample.off_policy_tokens = len(sample.response_ids)
            keep = await self._turns(trajectory, sample, ctx)
            if not keep and sample.status is not SampleStatus.FAILED:
                self._finish(trajectory.conversation, sample, ctx.tito_on_mismatch)
        finally:
            if keep:
                self._suspended[key] = trajectory
            elif trajectory is not None:
                await trajectory.close()
        return sample

    async def aclose(self) -> None:
        """Close the envs of trajectories still waiting to be continued (the run stops)."""
        suspended, self._suspended = list(self._suspended.values()), {}
        for trajectory in suspended:
            await trajectory.close()

    async def _start(self, trajectory: _Trajectory, sample: Sample, ctx: RolloutContext) -> None:
        env = trajectory.env
        first, held = normalize_messages(await env.reset(sample), role="user"), ()
        if not first:  # the sample's prompt, whose images the data reader read
            first, held = normalize_messages(sample.prompt, role="user"), tuple(sample.images)
        trajectory.tools = list(getattr(env, "tools", None) or [])
        fmt = ctx.chat_format if ctx.chat_format is not None else ctx.tokenizer
        trajectory.conversation = Conversation(fmt, first, trajectory.tools if self.tools_in_prompt else None,
                                               images=ctx.images, held=held)
        sample.prompt_ids = list(trajectory.conversation.prompt_ids)
        sample.images = list(trajectory.conversation.images)
        sample.metadata["tools"] = dict.fromkeys(TOOL_STATS, 0)
        sample.metadata["exec_s"] = []
        sample.metadata["tool_calls"] = []
        sample.metadata["tito"] = dict.fromkeys(TITO_STATS, 0)

    def _room(self, sample: Sample, ctx: RolloutContext) -> tuple[int, str]:
        """Tokens the trajectory may still add, and the limit that binds."""
        limits = [(1 << 62, "")]
        if self.max_total_tokens:
            limits.append((self.max_total_tokens - len(sample.response_ids),
                           f"max_total_tokens ({self.max_total_tokens}) reached"))
        if ctx.context_length:  # the engine needs the next token's position inside the context
            limits.append((ctx.context_length - 1 - len(sample.prompt_ids) - len(sample.response_ids),
                           f"the context length ({ctx.context_length} tokens) reached"))
        return min(limits)

    def _budget(self, sample: Sample, ctx: RolloutContext, in_turn: int) -> tuple[int, str]:
        """Tokens the next generation may add (the turn's own limit included), and the limit that binds."""
        per_turn = int(ctx.sampling_params.get("max_new_tokens", 16))
        return min(self._room(sample, ctx), (per_turn - in_turn, f"{_PER_TURN} ({per_turn})"))

    async def _turns(self, trajectory: _Trajectory, sample: Sample, ctx: RolloutContext) -> bool:
        """Run turns until the trajectory ends (False) or is aborted to be continued later (True)."""
        conversation, stats = trajectory.conversation, sample.metadata["tools"]
        while True:
            if ctx.abort_requested and len(sample.response_ids) == trajectory.turn_start:
                sample.status, sample.reason = SampleStatus.ABORTED, "partial rollout: stopped before its next turn"
                return True
            budget, limit = self._budget(sample, ctx, len(sample.response_ids) - trajectory.turn_start)
            if budget <= 0:
                sample.status, sample.reason = SampleStatus.TRUNCATED, limit
                return False
            stop_ids = conversation.format.request_stop_ids(ctx.sampling_params.get("stop_token_ids", ()))
            params = {**ctx.sampling_params, "max_new_tokens": budget, "stop_token_ids": stop_ids}
            images = {"image_data": [image.ref for image in sample.images]} if sample.images else {}
            answer = await ctx.engine.generate(sample.prompt_ids + sample.response_ids, params, return_logprob=True,
                                               **ctx.generate_options, **images)
            meta = answer["meta_info"]
            start = len(sample.response_ids)
            sample.record_sampling(start, params)
            sample.append(list(answer["output_ids"]), [float(t[0]) for t in meta["output_token_logprobs"]],
                          from_policy=True)
            sample.record_routing(meta, len(sample.prompt_ids) + start)
            sample.record_versions(start, meta)
            finish = meta["finish_reason"]["type"]
            if finish == "abort":
                sample.status, sample.reason = (SampleStatus.ABORTED,
                                                str(meta["finish_reason"].get("message", "aborted")))
                return True
            sample.turns += 1
            turn_ids = sample.response_ids[trajectory.turn_start:]
            turn = read_turn(conversation.format, turn_ids, trajectory.tools, tool_parser=ctx.tool_parser,
                             first_call_index=stats["calls"], seed=sample.metadata["trajectory"])
            text, checked = turn.text, turn.checked
            sample.response_text = turn.answer  # without its reasoning: what a reward scores
            cut = finish == "length"
            if cut:
                sample.status, sample.reason = SampleStatus.TRUNCATED, _cut_reason(sample.turns, limit)
                if not limit.startswith(_PER_TURN):
                    return False  # the trajectory's own room is used up: there is no next turn
                sample.metadata["turns_cut"] = sample.metadata.get("turns_cut", 0) + 1
                if self.on_cut_turn == "end":
                    return False
            valid = checked.valid
            stats["calls"] += len(checked.calls)
            sample.metadata["tool_calls"] += [{"turn": sample.turns, "name": c.name, "arguments": c.arguments,
                                               "error": c.error} for c in checked.calls]
            stats["parse_errors"] += checked.parse_errors
            stats["schema_errors"] += checked.schema_errors
            conversation.add_policy_turn(turn.message, turn_ids, cut=cut)
            # Calls that cannot run are answered here, with the reason; the env sees the valid ones only.
            messages = [{"role": "tool", "name": c.name, "tool_call_id": c.id, "content": f"error: {c.error}"}
                        for c in checked.calls if c.error is not None]
            done = False
            if valid or not checked.calls:
                result = await trajectory.env.step(Action(text, valid, list(turn_ids), cut=cut))
                messages += normalize_messages(result.observation, role="tool" if valid else "user")
                if result.reward is not None:
                    sample.metadata["env_reward"] = result.reward
                done = bool(result.done)
                self._count_results(valid, result.info.get("tool_results"), stats, sample.metadata["exec_s"])
            if done:
                if cut:
                    sample.reason += "; the env ended the trajectory"
                else:
                    sample.status = SampleStatus.COMPLETED
                return False
            sample.status, sample.reason = SampleStatus.PENDING, None  # the env goes on after a cut turn
            if sample.turns >= self.max_turns:
                sample.status, sample.reason = SampleStatus.TRUNCATED, f"max_turns ({self.max_turns}) reached"
                return False
            try:
                observation = conversation.extend(messages)
            except NotAppendOnly as exc:
                observation = self._mismatch(exc, conversation, messages, sample, ctx.tito_on_mismatch)
                if observation is None:
                    return False
            room, limit = self._room(sample, ctx)
            if len(observation) >= room:  # no room left for the observation and one more generated token
                sample.status, sample.reason = (SampleStatus.TRUNCATED,
                                                f"{limit} by the observation after turn {sample.turns}")
                return False
            sample.append(observation, None, from_policy=False)
            sample.images = list(conversation.images)  # the observation's images join the history's
            trajectory.turn_start = len(sample.response_ids)

    @staticmethod
    def _mismatch(exc: NotAppendOnly, conversation: Conversation, messages: list, sample: Sample,
                  on_mismatch: str) -> list[int] | None:
        """What ``rollout.tito.on_mismatch`` does when the history is not append-only: the tokens to append
        next, or None when the sample fails (``fail``)."""
        stats = sample.metadata["tito"]
        stats["mismatches"] += 1
        if on_mismatch == "fail":
            sample.fail(f"rollout: {exc} (rollout.tito.on_mismatch=fail; split or retokenize go on)")
            return None
        rendered = conversation.resync(messages)
        if on_mismatch == "split":
            stats["splits"] += 1
            sample.split(rendered, reason=f"rollout.tito: split after turn {sample.turns}: {exc}",
                         images=conversation.images)
            return []
        held = sample.prompt_ids + sample.response_ids
        same = first_differing_token(held, rendered)
        if same < len(sample.prompt_ids):
            sample.fail(f"rollout: {exc}; rollout.tito.on_mismatch=retokenize cannot re-render a changed prompt")
            return None
        stats["retokenized_tokens"] += len(held) - same
        sample.truncate_response(same - len(sample.prompt_ids))
        sample.images = list(conversation.images)  # the rendering's: kept and re-rendered images alike
        return rendered[same:]

    @staticmethod
    def _finish(conversation: Conversation, sample: Sample, on_mismatch: str) -> None:
        """The trajectory ended: its tokens held against the template's rendering of the whole conversation. A
        difference there (the template renders a finished conversation otherwise, e.g. drops the reasoning of its
        turns once an answer follows) is counted and recorded (``metadata["tito_final"]``); ``fail`` fails the
        sample. ``split`` and ``retokenize`` keep it as generated: every prompt the policy saw was the template's
        rendering, and nothing follows that a re-rendering would change."""
        exc = conversation.finish()
        if exc is None:
            return
        sample.metadata["tito"]["final_mismatches"] += 1
        sample.metadata["tito_final"] = str(exc)
        if on_mismatch == "fail":
            sample.metadata["tito"]["mismatches"] += 1
            sample.fail(f"rollout: {exc} (rollout.tito.on_mismatch=fail)")

    @staticmethod
    def _count_results(valid: list, results: list[ToolResult] | None, stats: dict[str, int],
                       exec_s: list[float]) -> None:
        if results is None:  # an env that runs no tools of its own reports nothing: its calls count as done
            stats["succeeded"] += len(valid)
            return
        for result in results:
            stats["succeeded"] += int(result.ok)
            stats["timeouts"] += int(result.timed_out)
            if result.exec_s is not None:
                exec_s.append(result.exec_s)
