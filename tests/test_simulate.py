"""Miles' control plane at scale, by simulation (miles.simulate): the simulated clock and engines, the published case
predicted, and the control plane's invariants held at every simulated step while engines die, straggle and join at
seeded random moments; and the invariants fail when the control plane is broken on purpose."""

import asyncio
import math
import random
from dataclasses import replace

import pytest

from miles.engine.router import Router
from miles.loop.schedules import GroupStream
from miles.simulate.clock import Stalled, VirtualLoop
from miles.simulate.cluster import Faults, InvariantBroken, simulate, summary
from miles.simulate.engines import EngineModel, LengthModel, SimEngine
from miles.simulate.published import PUBLISHED, published_case, split
from miles.types import Sample


def test_the_clock_jumps_to_the_next_timer_and_a_deadlock_is_named():
    loop = VirtualLoop()

    async def a_day_then_a_timeout():
        await asyncio.sleep(86_400)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 10)
        return loop.time()

    assert loop.run(a_day_then_a_timeout()) == 86_410

    async def waits_forever():
        await asyncio.Event().wait()

    with pytest.raises(Stalled, match="stalled at t=86410"):
        loop.run(waits_forever())
    loop.close()


def test_a_length_drawn_for_a_continued_request_is_longer_than_what_it_holds():
    lengths, rng = LengthModel(5000, 0.6), random.Random(0)
    fresh = sorted(lengths.draw(rng, 0) for _ in range(4000))
    assert fresh[2000] == pytest.approx(5000, rel=0.05)  # the median
    held = [lengths.draw(rng, 7000) for _ in range(4000)]
    assert min(held) > 7000
    # P(L > 9000 | L > 7000) from the distribution itself
    tail = lambda x: 0.5 * math.erfc((math.log(x) - math.log(5000)) / 0.6 / math.sqrt(2))  # noqa: E731
    assert sum(h > 9000 for h in held) / len(held) == pytest.approx(tail(9000) / tail(7000), abs=0.03)
    fitted = LengthModel.with_mean(5570, 0.5, 8192)
    assert fitted.truncated_mean(8192) == pytest.approx(5570, rel=1e-6)


def test_an_engine_decodes_as_its_model_says_and_admits_a_request_at_a_step():
    model = EngineModel(fixed_s=0.01, per_row_s=0.001, per_context_token_s=0.0, per_prefill_token_s=0.0)
    loop = VirtualLoop()

    async def run():
        exact = LengthModel(100, 1e-9)  # every response stops at 100 tokens
        engine = SimEngine("http://e", model, exact, prompt_tokens=10, token_scale=1, update_s=1.0, seed=0)
        engine.start()

        async def ask(max_new_tokens):
            answer = await engine.handle("/generate", {"input_ids": [1] * 10,
                                                       "sampling_params": {"max_new_tokens": max_new_tokens}})
            return answer, loop.time()

        first = asyncio.ensure_future(ask(1000))
        await asyncio.sleep(0.5)  # 45.45 steps of one row (11 ms each): the second joins at step 46
        second = asyncio.ensure_future(ask(30))
        return await first, await second

    (one, done_first), (two, done_second) = loop.run(run())
    assert len(one["output_ids"]) == 100 and one["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(two["output_ids"]) == 30 and two["meta_info"]["finish_reason"]["type"] == "length"
    # 46 steps alone (0.011 s), 30 together (0.012 s), 24 alone again
    assert done_second == pytest.approx(46 * 0.011 + 30 * 0.012)
    assert done_first == pytest.approx(46 * 0.011 + 30 * 0.012 + 24 * 0.011)
    loop.close()


def test_the_published_case_is_predicted_within_ten_percent_of_each_part():
    """Calibrated only from the post's throughputs, batch and truncation (miles/simulate/published.py); the weight
    update is taken as published, and the 75 s the post does not partition are not modelled."""
    result = summary(simulate(published_case(steps=3)))
    for part in ("rollout_s", "logprob_s", "train_s"):
        assert result[part] == pytest.approx(PUBLISHED[part], rel=0.10), part
    four = sum(PUBLISHED[k] for k in ("rollout_s", "logprob_s", "train_s", "update_s"))
    assert result["step_s"] == pytest.approx(four, rel=0.10)
    assert 1000 < result["tokens_per_step"] / result["rollout_s"] / 8 < 1300  # the post: 1.1k-1.3k per GPU


FAULTS = Faults(kills_per_engine_hour=2.0, restart_s=60.0, stragglers={1: 3.0}, joins=((200.0, 2),),
               leaves=((900.0, 1),))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("schedule,fields", [
    ("sync", {"partial_rollout": False}),
    ("sync", {"partial_rollout": True}),
    ("one_step_off", {}),
    ("async", {"max_staleness": 1, "partial_rollout": True}),
    ("async", {"max_staleness": 2, "partial_rollout": False}),
])
def test_the_control_plane_keeps_its_invariants_while_engines_die_straggle_join_and_leave(schedule, fields, seed):
    """Engines killed at seeded random moments (generating, during a push, during a catch-up), one three times
    slower, two joining mid-run, one leaving (drained): every step checks that nothing is trained twice or lost,
    that staleness stays within its bound and that engines in service hold the weights pushed, and no request
    reaches an engine that left (miles.simulate.cluster.Invariants)."""
    scenario = replace(published_case(**split(16, 8, 8, engine_size=2), schedule=schedule, steps=6, token_scale=512,
                                      seed=seed, **fields), faults=FAULTS)
    records = simulate(scenario)
    assert len(records) == 6 and all(r.samples + r.failed == 64 * 8 for r in records)  # failed: counted, not lost
    assert sum(r.failed for r in records) < 0.05 * 6 * 64 * 8  # a request is retried on another engine
    failures = sum(r.metrics["rollout/engine_failures"] for r in records)
    back = sum(r.metrics["rollout/readmissions"] for r in records)
    assert failures > 0 and back >= 2  # engines did die, and the joining ones were caught up before serving
    assert records[-1].metrics["sim/engines_left"] == 1  # and no request reached it after (Invariants.serving)


def test_a_stream_that_judges_a_group_by_its_newest_tokens_is_caught(monkeypatch):
    """Admitting past the bound and ageing a group by its newest tokens (not its oldest) trains stale tokens."""
    monkeypatch.setattr(GroupStream, "cap", property(lambda self: (self.s.max_staleness + 3) * self.batch))
    monkeypatch.setattr(Sample, "start_version", property(lambda self: max(self.weight_versions, default=None)))
    scenario = published_case(**split(16, 8, 8, engine_size=2), schedule="async", max_staleness=1, steps=6,
                              token_scale=512, partial_rollout=True)
    with pytest.raises(InvariantBroken, match="versions old, over max_staleness 1"):
        simulate(scenario)


def test_an_engine_back_in_service_without_its_catch_up_is_caught(monkeypatch):
    async def readmit_without_catch_up(self, engine):
        engine.quarantined = False
        return True

    monkeypatch.setattr(Router, "_readmit", readmit_without_catch_up)
    scenario = replace(published_case(**split(16, 8, 8, engine_size=2), schedule="async", partial_rollout=False,
                                      steps=6, token_scale=512),
                       faults=Faults(joins=tuple((float(t), 1) for t in range(1000, 3000, 97))))  # at many moments
    with pytest.raises(InvariantBroken, match="on version 0"):  # serving, or left out of a push
        simulate(scenario)


def test_an_engine_removed_without_draining_answers_its_requests_with_what_they_hold():
    """Router.remove_engine(drain=False) on the real router: the leaving engine's running requests are aborted and
    answered with their tokens so far; the next requests go to the engine that stays."""
    from miles.engine.router import EngineEndpoint
    from miles.simulate.engines import SimSession

    model = EngineModel(fixed_s=0.01, per_row_s=0.0, per_context_token_s=0.0, per_prefill_token_s=0.0)
    loop = VirtualLoop()

    async def run():
        engines = {f"http://e{i}": SimEngine(f"http://e{i}", model, LengthModel(1000, 1e-9), prompt_tokens=2,
                                             token_scale=1, update_s=1.0, seed=i) for i in range(2)}
        router = Router([], batch_requests=False)
        router.engines = [EngineEndpoint(url) for url in engines]
        router._session = SimSession(engines)
        for engine in engines.values():
            engine.start()
        params = {"max_new_tokens": 100}
        burst = [asyncio.ensure_future(router.generate([1, 1], params)) for _ in range(4)]
        await asyncio.sleep(0.5)  # 50 steps in
        leaving, staying = router.engines
        await router.remove_engine(leaving, drain=False)
        answers = await asyncio.gather(*burst)
        later = await asyncio.gather(*(router.generate([1, 1], params) for _ in range(4)))
        return answers, later, leaving, staying

    answers, later, leaving, staying = loop.run(run())
    finishes = sorted((a["meta_info"]["finish_reason"]["type"], len(a["output_ids"])) for a in answers)
    assert finishes == [("abort", 50), ("abort", 50), ("length", 100), ("length", 100)]
    assert [a["meta_info"]["finish_reason"]["type"] for a in later] == ["length"] * 4
    assert leaving.served == 2 and staying.served == 6 and leaving.gone and leaving.outstanding == 0
    loop.close()
