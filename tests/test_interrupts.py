"""Ctrl-C and SIGTERM while the main thread runs rollouts: :func:`miles.interrupts.run` cancels the coroutine,
lets it unwind on a sound loop, and raises the interruption after; a second signal raises at once."""

import asyncio
import os
import random
import signal
import sys
import threading

import pytest

from miles import interrupts


@pytest.fixture
def handled(monkeypatch):
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # Python's own, as the CLI has it
    with interrupts.handling():
        yield


def _signal_when(ready: threading.Event, signum: int, delay_s: float = 0.0,
                 to_this_thread: bool = False) -> threading.Thread:
    """``to_this_thread``: the kernel hands the signal to the sending thread, not the main one (as it may in a
    process with many threads: Ray's, gRPC's); only the loop's wakeup then tells the main thread."""
    def send():
        ready.wait()
        threading.Event().wait(delay_s)
        if to_this_thread:
            signal.pthread_kill(threading.get_ident(), signum)
        else:
            os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("seed", range(4))
def test_a_signal_at_a_random_moment_of_spawning_subprocesses_unwinds_the_coroutine(handled, seed):
    """The signal lands anywhere in a loop that spawns subprocesses (where a raised KeyboardInterrupt used to
    leave a task with an unretrieved exception): the coroutine's ``finally`` runs, can still spawn one, and
    the caller gets KeyboardInterrupt."""
    started, unwound = threading.Event(), []

    async def spawning():
        try:
            while True:
                proc = await asyncio.create_subprocess_exec("true")
                await proc.wait()
                started.set()
        finally:
            proc = await asyncio.create_subprocess_exec("true")
            unwound.append(await proc.wait())

    sender = _signal_when(started, signal.SIGINT, random.Random(seed).uniform(0, 0.05))
    with pytest.raises(KeyboardInterrupt) as raised:
        interrupts.run(spawning())
    sender.join()
    assert type(raised.value) is KeyboardInterrupt and unwound == [0]
    interrupts.check()  # nothing left pending


@pytest.mark.parametrize("to_this_thread", [False, True], ids=["to-the-process", "to-another-thread"])
def test_sigterm_raises_terminated_after_the_coroutine_unwound(handled, to_this_thread):
    started, unwound = threading.Event(), []

    async def waiting():
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            unwound.append(True)

    sender = _signal_when(started, signal.SIGTERM, to_this_thread=to_this_thread)
    with pytest.raises(interrupts.Terminated):
        interrupts.run(waiting())
    sender.join()
    assert unwound == [True]


@pytest.mark.parametrize("to_this_thread", [False, True], ids=["to-the-process", "to-another-thread"])
def test_a_second_signal_while_unwinding_raises_at_once(handled, to_this_thread):
    """A ``finally`` that hangs does not hold the run: the second Ctrl-C raises without waiting for it."""
    started, unwinding = threading.Event(), threading.Event()

    async def stuck():
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            unwinding.set()
            await asyncio.Event().wait()

    first = _signal_when(started, signal.SIGINT, to_this_thread=to_this_thread)
    second = _signal_when(unwinding, signal.SIGINT, to_this_thread=to_this_thread)
    with pytest.raises(KeyboardInterrupt):
        interrupts.run(stuck())
    first.join(), second.join()


def test_a_coroutine_that_finishes_normally_returns_its_value_and_handlers_are_restored(handled):
    async def answer():
        await asyncio.sleep(0)
        return 42

    assert interrupts.run(answer()) == 42
    assert signal.getsignal(signal.SIGINT) is interrupts._on_signal
    assert signal.getsignal(signal.SIGTERM) is interrupts._on_signal


def test_an_interruption_python_drops_is_not_reported_but_raised_at_the_next_check(handled, capsys):
    """A signal in a ``__del__`` (or a weakref callback): Python drops the KeyboardInterrupt and would print
    "Exception ignored ... Traceback"; nothing is printed, the next check raises it. Other dropped exceptions
    are still reported."""

    class Dying:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):  # the Python-level handler runs in here
                pass

    class Failing:
        def __del__(self):
            raise ValueError("a real error in a destructor")

    Dying()
    assert capsys.readouterr().err == ""
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()
    Failing()
    err = capsys.readouterr().err
    assert "Exception ignored" in err and "a real error in a destructor" in err


def test_after_the_block_the_handlers_are_back_and_nothing_is_pending(monkeypatch):
    """A process that runs again (a notebook, a test session) after an interrupted run: the last run's signal
    is not raised in the next one, and the signals are handled as before the run."""
    hook, before = sys.unraisablehook, (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    with pytest.raises(KeyboardInterrupt):
        with interrupts.handling():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):
                pass
    # what the process had (Python's KeyboardInterrupt; SIG_IGN in a shell's background job)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert sys.unraisablehook is hook
    interrupts.check()  # nothing pending

    async def answer():
        return 7

    assert interrupts.run(answer()) == 7


def _lock_left_released(interruption):
    """What CI saw: the signal lands in ``Condition.wait`` after the lock's release, and the ``with`` around the wait
    fails to release it again, raising RuntimeError while the interruption unwinds."""
    lock = threading.RLock()  # a Condition's lock, as a future's
    with threading.Condition(lock):
        lock.release()  # Condition.wait's _release_save, just before the signal handler raised
        raise interruption


@pytest.mark.parametrize("interruption, code, said", [(KeyboardInterrupt, 130, "miles: interrupted"),
                                                      (interrupts.Terminated, 143, "miles: terminated (SIGTERM)")])
def test_an_error_raised_while_an_interruption_unwinds_is_reported_as_the_interruption(monkeypatch, capsys,
                                                                                        interruption, code, said):
    from miles import cli

    with pytest.raises(RuntimeError, match="un-acquired lock") as raised:
        _lock_left_released(interruption)
    assert interrupts.interruption(raised.value).__class__ is interruption
    assert interrupts.interruption(RuntimeError("a plain error")) is None

    monkeypatch.setattr(cli, "_cmd_plugins", lambda args: _lock_left_released(interruption))
    assert cli.main(["plugins"]) == code
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_train_names_the_resume_command_when_the_interruption_came_wrapped(monkeypatch, capsys, tmp_path):
    from miles import cli
    from miles.run import runner

    monkeypatch.setattr(runner, "train", lambda prepared: _lock_left_released(KeyboardInterrupt))
    assert cli.main(["train", "configs/quickstart.yaml", f"run.dir={tmp_path / 'run'}"]) == 130
    err = capsys.readouterr().err
    assert "miles: interrupted" in err and "miles train configs/quickstart.yaml" in err, err
