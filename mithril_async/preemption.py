"""A preemption signal becomes a save: ``[checkpointing] save_on_signals``.

SLURM and Kubernetes send SIGTERM some seconds before their SIGKILL (SLURM's
``--signal=USR1@90`` sends SIGUSR1 earlier). With ``save_on_signals = ["SIGTERM"]`` the
manager's handler records the signal instead of letting it end the process, the loop's next
``should_save(step)`` returns True, and once the save it asks for is durable the signal takes
the effect it would have had without us: its previous disposition (for SIGTERM's default the
process ends killed by SIGTERM, exit status -15, 143 in a shell). With
``exit_after_signal_save = false`` the signal is consumed instead: ``manager.preempted``
becomes True and the loop decides.

The rules, per process:

- **Main thread only.** Python runs signal handlers on the main thread and lets only it
  install them, so a manager with ``save_on_signals`` made on another thread raises
  :class:`~mithril_async.errors.ConfigError` (make it on the main thread, or set
  ``save_on_signals = []`` for that manager). A signal whose handler was installed outside
  Python cannot be chained and is refused the same way.
- **Chaining.** The handler that was installed before ours is the previous disposition: it
  is called (or the default action taken, or nothing for ``SIG_IGN``) when the signal takes
  effect, after the save. ``close()`` puts it back (if ours is still the installed one; a
  handler installed over ours later is left, and ours then passes every signal on at once).
- **Grace.** If no save is asked for (a ``save()`` call) within ``signal_grace_s``, the signal
  takes effect anyway: a loop that never calls ``should_save`` is not kept alive. Once a save
  is asked for, it is waited for; one that did not start (skipped because the pipeline was
  busy, ``on_busy = "skip"``, or a ``save()`` that raised) is asked for again at the next
  ``should_save``, the grace starting anew; one that failed is logged at ERROR and the
  signal takes effect all the same.
- **A second signal** of this process while its save is pending takes effect at once (the
  first asks for a save, the second insists), as does any signal after ``close()``.
- **From any thread.** A default disposition is applied without the main thread (the C
  library's ``signal()``, then ``kill()``), so a main thread stuck in a C call, such as a
  collective waiting on a rank that is gone, does not keep the process alive. A previous
  handler written in Python runs on the main thread, as Python runs every handler.

**Several ranks.** SLURM signals the ranks of a job at slightly different moments, and each
rank must save the same step or the version is not one state. ``should_save`` calls are
points every rank passes in the same order, so the ranks agree there, without a collective
at every step: every few calls (as many as rank 0's pace puts in about a quarter of a second;
every call when steps are slower) they *meet*: each posts its fresh signal (0 when none) to an
all-reduce (max) on a gloo group of its own and reads the result of the previous meeting's; a
non-zero result makes *every* rank answer True at that same call, within about two gaps of
the signal. The other calls cost a counter decrement. A meeting does not wait on the
network in practice: its all-reduce was posted a meeting earlier (ranks in data-parallel
lockstep). The group is separate from the manager's coordinator group because saves run
their collectives on that one from background threads, and gloo pairs collectives by their
order on a group. So the contract: with several ranks, call ``should_save`` at every step on
every rank (and give every rank the same ``save_on_signals``). A rank that got no signal
itself saves all the same and, with ``exit_after_signal_save``, ends by the agreed signal
once its save is durable (the job is ending: a rank left alone would hang in its next
collective). A signal that arrives while a save for a signal is on its way is covered by
that save.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any, Literal

import torch
import torch.distributed as dist

from mithril_async.config import CheckpointingConfig
from mithril_async.errors import ConfigError, DistributedError
from mithril_async.listeners import ResultListeners
from mithril_async.save.coordinator import Coordinator, GroupBacked
from mithril_async.save.results import SaveResult

__all__ = ["Preemption", "RankAgreement"]

log = logging.getLogger("mithril_async")

#: where a signal save stands on this rank: none asked for by a signal ("idle"), to be asked
#: for ("due": ``should_save`` answers True), asked for (``save()`` called), running (started)
Phase = Literal["idle", "due", "asked", "running"]
_Handler = Callable[[int, FrameType | None], Any] | int


def _on_main_thread(names: list[str]) -> None:
    where = threading.current_thread()
    if where is not threading.main_thread():
        raise ConfigError(f"checkpointing.save_on_signals = {names}: signal handlers can only "
                          f"be installed from the main thread, and this manager is made on "
                          f"thread {where.name!r}; make it on the main thread or set "
                          "save_on_signals = [] for it")


def _terminate(signum: int) -> None:
    """End the process by ``signum``'s default action, from any thread."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # Python lets only the main thread set a disposition; the C library does not care
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signum, None)  # SIG_DFL
    os.kill(os.getpid(), signum)


class RankAgreement:
    """Where the ranks meet to combine their fresh signals: one all-reduce (max) on a gloo
    group of its own at a meeting, read at the next meeting.

    Meetings are ``should_save`` calls every ``every`` calls, the same calls on every rank:
    each meeting's result also carries rank 0's ``every`` for the gap after the next one,
    chosen from its own pace so that the ranks meet about every :attr:`MEET_S` seconds
    (every call when steps are slower), never more than :attr:`MAX_EVERY` calls apart. Most
    calls are a counter decrement; a signal is acted on within about two gaps.
    """

    #: seconds between two meetings the ranks aim for
    MEET_S = 0.25
    #: the most calls between two meetings (bounds the delay if steps suddenly slow down)
    MAX_EVERY = 1000

    def __init__(self, group: Any, rank: int, timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.timeout_s = timeout_s
        #: [largest fresh signal, rank 0's proposed gap]
        self._buf = torch.zeros(2, dtype=torch.int64)
        self._work: Any = None
        self._broken = False
        #: calls to let pass before the next meeting; the gap agreed for now
        self._skip = 0
        self._every = 1
        #: rank 0: when it last posted, and the calls since (its pace decides the gaps)
        self._posted_at: float | None = None
        self._calls = 0
        #: meetings so far (for tests and logs)
        self.meetings = 0

    @classmethod
    def of(cls, coordinator: Coordinator) -> RankAgreement | None:
        """The agreement among ``coordinator``'s ranks (None for one rank). Every rank makes
        it at the same point, as it makes its manager (creating a group is collective)."""
        if coordinator.world_size <= 1:
            return None
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("checkpointing.save_on_signals: several ranks agree on the step to "
                              "save over torch.distributed, which is not initialised")
        base, timeout_s = None, 300.0
        if isinstance(coordinator, GroupBacked):  # the default world group otherwise
            base, timeout_s = coordinator.group, float(coordinator.timeout_s)
        ranks = (dist.get_process_group_ranks(base) if base is not None
                 else list(range(dist.get_world_size())))
        if len(ranks) != coordinator.world_size:
            raise ConfigError(f"checkpointing.save_on_signals: the coordinator has "
                              f"{coordinator.world_size} ranks but no process group naming "
                              "them to agree over")
        group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                               use_local_synchronization=True)
        return cls(group, coordinator.rank, timeout_s)

    def meets(self) -> bool:
        """Whether this ``should_save`` call is a meeting (then :meth:`collect`, then
        :meth:`post`)."""
        self._calls += 1
        if self._skip:
            self._skip -= 1
            return False
        return True

    def collect(self) -> int:
        """The largest signal any rank posted at the previous meeting (0: none)."""
        work, self._work = self._work, None
        self.meetings += 1
        if work is None:
            return 0
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as err:
            self._broken = True
            raise DistributedError(
                f"rank {self.rank}: the ranks could not agree whether a signal asks for a save "
                f"({type(err).__name__}: {err}); a peer rank died, or does not call "
                "should_save() at the same steps") from err
        signum, self._every = int(self._buf[0]), max(1, int(self._buf[1]))
        self._skip = self._every - 1
        return signum

    def post(self, value: int) -> None:
        """Post this meeting's value (the previous one was collected)."""
        proposal = 0
        if self.rank == 0:
            now = time.monotonic()
            if self._posted_at is None:
                proposal = 1
            else:  # the calls since the last meeting took this long: aim at MEET_S
                per_call = max(now - self._posted_at, 1e-9) / self._calls
                proposal = max(1, min(self.MAX_EVERY, int(self.MEET_S / per_call)))
            self._posted_at, self._calls = now, 0
        self._buf[0], self._buf[1] = value, proposal
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group,
                                     async_op=True)

    def close(self) -> None:
        """Destroy the group, unless a peer never joined the last all-reduce (a thread of
        gloo may still wait in it: the group is left to the process's end)."""
        work, self._work = self._work, None
        if self._broken or (work is not None and not work.is_completed()):
            return
        try:
            dist.destroy_process_group(self.group)
        except Exception as err:  # the default group may be gone at shutdown
            log.debug("could not destroy the signal agreement group: %r", err)


class Preemption:
    """``save_on_signals`` of one manager: the handlers, the grace timer, the agreement of
    the ranks and what happens once the save is durable (module docs)."""

    def __init__(self, names: list[str], *, exit_after_save: bool, grace_s: float,
                 listeners: ResultListeners, agreement: RankAgreement | None = None) -> None:
        _on_main_thread(names)
        self.signals = [signal.Signals[n] for n in names]
        self.exit_after_save = exit_after_save
        self.grace_s = grace_s
        #: where the ranks agree (None: one rank)
        self.agreement = agreement
        self._previous: dict[int, _Handler] = {}
        for s in self.signals:
            prev = signal.getsignal(s)
            if prev is None:
                raise ConfigError(f"checkpointing.save_on_signals: {s.name} has a handler "
                                  "that was not installed from Python; it cannot be chained")
            self._previous[s] = prev
        #: exit_after_save = false: True once the save a signal asked for ended (committed,
        #: or failed: the manager raises that as usual); the loop should stop
        self.preempted = False
        #: the grace ran out before a save was asked for (the signal was delivered)
        self.grace_expired = False
        self._lock = threading.Lock()
        #: wakes the watchdog; a SimpleQueue's put is reentrant, so the handler may use it
        self._inbox: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        # this process's own signal (0: none), when it came, whether the ranks were told,
        # whether it took effect; the handler writes them without a lock (it runs between
        # two bytecodes of the main thread, which may hold any lock)
        self._own = 0
        self._own_at = 0.0
        self._own_posted = False
        self._given = False
        # the save the ranks agreed on: the signal, the phase, the step asked for
        self._cycle = 0
        self._phase: Phase = "idle"
        self._step: int | None = None
        #: a signal the main thread must pass to a Python previous handler
        self._release = 0
        self._closed = False
        listeners.add(self._on_result, last=True)
        for s in self.signals:
            signal.signal(s, self._on_signal)
        self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                          name="mithril-signals")
        self._watchdog.start()

    @classmethod
    def from_config(cls, cfg: CheckpointingConfig, coordinator: Coordinator,
                    listeners: ResultListeners) -> Preemption | None:
        """The manager's signal saves, or None when ``save_on_signals`` is empty."""
        if not cfg.save_on_signals:
            return None
        _on_main_thread(cfg.save_on_signals)  # before the agreement's group is made
        return cls(cfg.save_on_signals, exit_after_save=cfg.exit_after_signal_save,
                   grace_s=cfg.signal_grace_s, listeners=listeners,
                   agreement=RankAgreement.of(coordinator))

    # ---------------------------------------------------------------- the handler
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """On the main thread, between two bytecodes: plain assignments and a reentrant put."""
        if self._closed or self._release == signum or self._own:
            # after close, a release for a Python handler, or a second signal: effect now
            self._release = 0
            self._given = True
            self._take_effect(signum, frame)
            return
        self._given = False
        self._own_posted = False
        self._own_at = time.monotonic()
        self._own = signum
        self._inbox.put(("signal", signum))  # logged by the watchdog: never write from a handler

    def _take_effect(self, signum: int, frame: FrameType | None) -> None:
        """Apply the previous disposition of ``signum`` (on the main thread, or a default)."""
        prev = self._previous.get(signum, signal.SIG_DFL)
        if prev == signal.SIG_IGN:
            return
        if prev == signal.SIG_DFL or not callable(prev):
            _terminate(signum)
        else:
            prev(signum, frame)

    def _deliver(self, signum: int) -> None:
        """Give ``signum`` its effect now, from any thread."""
        prev = self._previous.get(signum, signal.SIG_DFL)
        if callable(prev) and threading.current_thread() is not threading.main_thread():
            self._release = signum  # the main thread's handler calls it
            main = threading.main_thread().ident
            assert main is not None
            signal.pthread_kill(main, signum)
        else:
            self._take_effect(signum, None)

    # ---------------------------------------------------------------- the loop's side
    def due(self, step: int) -> bool:
        """Whether ``step`` must be saved for a signal. Called at every ``should_save`` on
        every rank, in the same order: with several ranks the ranks agree there."""
        ag = self.agreement
        meet = ag is None or ag.meets()
        if (ag is None or not meet) and not self._own and self._phase == "idle":
            return False  # nothing to tell the ranks, nothing due: the cost of most steps
        agreed = ag.collect() if ag is not None and meet else 0
        with self._lock:
            retry = self._phase == "asked"  # the save() asked for raised before it started
            if retry:
                self._ask_again()
            fresh = (self._own if meet and self._own and not self._own_posted
                     and self._phase == "idle" else 0)
            if ag is None:
                agreed = fresh
            if agreed:  # every rank starts this save at this same call
                self._cycle, self._phase, self._step = agreed, "due", None
                self._own_posted = True  # a signal of this rank that came so far is covered
                fresh = 0
            elif fresh:
                self._own_posted = True  # the ranks act on it at the next meeting
            answer = self._phase == "due"
        if ag is not None and meet:
            ag.post(fresh)
        if retry:
            self._inbox.put(("wake", 0))
        if agreed:
            log.warning("step %d is saved for %s%s", step, signal.Signals(agreed).name,
                        "" if self._own else " (another rank received it)")
        return answer

    def saving(self, step: int) -> None:
        """A ``save(step)`` call began: the save a signal asked for, when one is due."""
        with self._lock:
            if self._phase == "due":
                self._phase, self._step = "asked", step
        self._inbox.put(("wake", 0))

    def submitted(self, step: int) -> None:
        """The save of ``step`` was started (its result will come)."""
        with self._lock:
            if self._phase == "asked" and self._step == step:
                self._phase = "running"

    def _on_result(self, res: SaveResult) -> None:
        """After every user listener saw ``res``: end the signal's save when it is this."""
        with self._lock:
            if res.step != self._step or self._phase not in ("asked", "running"):
                return
            if res.status == "skipped":  # the pipeline was busy: ask again
                self._ask_again()
                self._inbox.put(("wake", 0))
                return
            signum = self._own or self._cycle
            self._phase, self._step, self._cycle = "idle", None, 0
            if self.exit_after_save:
                self._given = True
            else:
                self.preempted = True
                self._own, self._own_posted = 0, False
        self._inbox.put(("wake", 0))
        name = signal.Signals(signum).name
        if res.status != "committed":  # never called durable: it is not
            log.error("the save of step %d asked for by %s failed (%s); %s", res.step, name,
                      res.error, "the signal takes effect all the same" if
                      self.exit_after_save else "manager.preempted is set all the same")
        elif self.exit_after_save:
            log.warning("step %d is durable (%s): %s takes effect", res.step, res.version_id,
                        name)
        if self.exit_after_save:
            self._deliver(signum)

    def _ask_again(self) -> None:
        """The save asked for did not start (skipped, or save() raised): ``should_save``
        answers True again, and the grace starts anew (the loop is asking). Under the lock."""
        self._phase, self._step = "due", None
        self._own_at = time.monotonic()

    # ---------------------------------------------------------------- the grace timer
    def _deadline(self) -> float | None:
        with self._lock:
            if (not self._own or self._given or self._closed
                    or self._phase in ("asked", "running")):
                return None
            return self._own_at + self.grace_s

    def _watch(self) -> None:
        while True:
            deadline = self._deadline()
            try:
                msg, signum = self._inbox.get(timeout=None if deadline is None
                                              else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                msg, signum = "grace", 0
            if msg == "close":
                return
            if msg == "signal":
                log.warning("received %s: the next should_save() asks for a save, and the "
                            "signal takes effect once it is durable (or in %g s if none is "
                            "asked for)", signal.Signals(signum).name, self.grace_s)
            elif msg == "grace":
                self._grace_ran_out()

    def _grace_ran_out(self) -> None:
        deadline = self._deadline()
        if deadline is None or time.monotonic() < deadline:
            return
        with self._lock:
            signum, self._given, self.grace_expired = self._own, True, True
        log.warning("no save was asked for within signal_grace_s = %g s of %s: it takes "
                    "effect now", self.grace_s, signal.Signals(signum).name)
        self._deliver(signum)

    # ---------------------------------------------------------------- close
    def close(self) -> None:
        """Put the previous handlers back (from the main thread, where ours is still the one
        installed); a signal not acted on yet takes effect now."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = self._own if self._own and not self._given else 0
            self._given = True
        self._inbox.put(("close", 0))
        if threading.current_thread() is threading.main_thread():
            for s, prev in self._previous.items():
                if signal.getsignal(s) == self._on_signal:
                    signal.signal(s, prev)
        if self.agreement is not None:
            self.agreement.close()
        if pending:
            log.warning("the manager closed with %s not acted on: it takes effect now",
                        signal.Signals(pending).name)
            self._deliver(pending)
