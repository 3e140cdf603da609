"""The step boundary on the training thread: :class:`SafePoint`.

The only place the model or optimizer changes (DESIGN.md §3 rule 1). It runs in the global
optimizer step post-hook of the primary optimizer (the first one found stepping the watched
model's parameters, or the one passed; another of the model's optimizers takes over when the
primary is collected, or steps twice while it does not: :meth:`SafePoint._takes_over`), or in
``Monitor.step()`` for loops without one, and in that order:

1. the per-module activation profile of the step just recorded (table actions need one);
2. the accounting while gradients and optimizer state are all alive (the step's peak of static
   memory; asked for by the sampler after each reading, or every step when enforcing or
   forecasting: the step's peak then goes to ``Policy.observe_step``);
3. the CPU budget enforced against this step's peak (``enforce=True``; the model's other
   optimizers' steps are checked too, each right after it, without a boundary);
4. the policy's ``on_pressure`` hooks, then its pending decision applied (the tuner); in a
   multi-rank job only every ``sync_every_steps`` counted steps, after the ranks agreed on one
   decision (:class:`edo_monitor.agent.ranks.Coordinator`);
5. closing the step (in ``finally``): count it, reset the activation peak, check for steady
   growth, arm the next profile.

Between a failed attempt of ``Monitor.run_step`` and its retry, :meth:`SafePoint.recovery_point`
runs step 4 only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.optim.optimizer import register_optimizer_step_post_hook

from edo_monitor.actions.activation_profile import ActivationRecorder
from edo_monitor.actions.enforce import enforce_budget
from edo_monitor.agent.grads_alive import GradientsAlive
from edo_monitor.decide.leaks import GrowthDetector
from edo_monitor.errors import BudgetOutOfMemoryError
from edo_monitor.measure.accounting import Accounting
from edo_monitor.units import format_bytes

if TYPE_CHECKING:
    from edo_monitor.agent.state import MonitorState

logger = logging.getLogger(__name__)

__all__ = ["SafePoint"]


class SafePoint:
    """Step counting, measurement and the application of decisions at each step boundary.

    Args:
        monitor: the run (read: model, optimizers, policy, tracker, budget; written: ``steps``,
            ``optimizers``, ``activation_profile``).

    Attributes:
        enforcing: the CPU budget is enforced (``enforce=True`` in CPU-budget mode).
        grads_alive: while enforcing with a tracker, the gradients alive in the step
            (:class:`GradientsAlive`); else ``None``.
        step_accounting: the accounting of the last step boundary (``None`` before one); the
            readings use it.
        oom_accounting: while a CPU-budget out-of-memory error is recorded, the accounting its
            check read (the ``oom`` snapshot uses it rather than walking the model again);
            otherwise ``None``.
        want_accounting: the sampler has taken a reading since: account at the next boundary.
        primary: the optimizer whose steps are counted (``None`` until found).
    """

    def __init__(self, monitor: MonitorState) -> None:
        self.m = monitor
        self.enforcing = False
        self.grads_alive: GradientsAlive | None = None
        #: the model has a lazy module's parameters not yet materialised (``nn.LazyLinear``)
        self._lazy = monitor.model is not None and any(
            is_lazy(p) for p in monitor.model.parameters()
        )
        self.step_accounting: Accounting | None = None
        self.oom_accounting: Accounting | None = None
        # the first boundary accounts whatever the sampler did: a run whose steps all end
        # before the sampler's first tick (a starved thread) kept no accounting with gradients,
        # and its last reading said 0 bytes of gradients
        self.want_accounting = True
        # held weakly: a dropped optimizer is freed, and the next one stepping the model counts
        self._primary: weakref.ref[torch.optim.Optimizer] | None = (
            weakref.ref(monitor.optimizers[0]) if monitor.optimizers else None
        )
        self._primary_steps = 0  # the primary's steps
        # per other optimizer of the model: the primary's steps at its last step
        self._seen_at: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = (
            weakref.WeakKeyDictionary()
        )
        self._explicit_optimizers = bool(monitor.optimizers)
        self._classified: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = (
            weakref.WeakKeyDictionary()
        )
        self._hook_handle: Any = None
        self._last_static_bytes = 0
        self._recorder: ActivationRecorder | None = None
        self._recorder_thread: int | None = None
        self._warned_thread = False
        self._profiled_at_s = -float("inf")
        # applied actions whose saving the next recorded forward measures: waiting for a
        # recording to start, and measured by the one running
        self._to_measure: list[tuple[Any, Any, Any]] = []
        self._measuring: list[tuple[Any, Any, Any]] = []
        self._leaks = GrowthDetector()  # steady growth of saved tensors across steps
        # per table weight: its gradient (a weak reference) and version as its optimizer's last
        # step left it (grad_spent); per optimizer: the table weights it steps
        # (by id: a tensor is no dictionary key) the weight's and its gradient's weak
        # references and the gradient's version
        self._spent: dict[int, tuple[Any, Any, int]] = {}
        self._tables_of: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = (
            weakref.WeakKeyDictionary()
        )

    # ------------------------------------------------------------------ hooks
    def install(self) -> None:
        """Register the global optimizer step post-hook."""
        self._last_static_bytes = self.m.accounting.total_bytes
        self._hook_handle = register_optimizer_step_post_hook(self.on_optimizer_step)

    def remove(self) -> None:
        """Remove the step hook and the gradients' hooks (idempotent)."""
        if self.grads_alive is not None:
            self.grads_alive.remove()
            self.grads_alive = None
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None

    @property
    def primary(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps are counted (``None`` until found, or once collected)."""
        return self._primary() if self._primary is not None else None

    def _takes_over(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``, another optimizer of the model, becomes the primary at this
        step: the primary is gone (collected), or did not step since ``optimizer``'s last step
        (a new optimizer of a second phase of training, the old one still referenced; or one
        that steps more often than it). Counting then goes on with it, from this step."""
        if self.primary is None:
            return True
        seen = self._seen_at.get(optimizer)
        self._seen_at[optimizer] = self._primary_steps
        return seen == self._primary_steps

    def _inactive(self) -> bool:
        """A forked child, or a block that is closing."""
        return os.getpid() != self.m._pid or self.m._stop.is_set()

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """PyTorch's global optimizer step post-hook: the safe point of the primary optimizer."""
        if self._inactive():
            return
        try:
            if optimizer is not self.primary and not self._classify(optimizer):
                return
            self._note_spent(optimizer)
            if optimizer is not self.primary and self._takes_over(optimizer):
                logger.info(
                    "edo-monitor: steps are counted on %s from step %d (the optimizer counted "
                    "before is gone or stopped stepping)",
                    type(optimizer).__name__,
                    self.m.steps + 1,
                )
                self._primary = weakref.ref(optimizer)
            if optimizer is self.primary:
                self._primary_steps += 1
                self.run(count=True)
            elif self.enforcing:  # its state was made in this step, after the primary's check
                self._check_step(self.m._account())
        except BudgetOutOfMemoryError:
            raise  # enforce=True: the budget's out-of-memory error is the user's to see
        except Exception as exc:
            self.m._agent_error("step hook", exc)

    def _classify(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps the watched model (remembered per optimizer)."""
        known = self._classified.get(optimizer)
        if known is not None:
            return known
        m = self.m
        if self._explicit_optimizers:
            steps_model = optimizer in m.optimizers
        elif m.model is None:
            steps_model = self.primary is None
        else:
            ids = {id(p) for p in m.model.parameters()}
            steps_model = any(id(p) in ids for g in optimizer.param_groups for p in g["params"])
        self._classified[optimizer] = steps_model
        if steps_model:
            m.add_optimizer(optimizer)
            if self.primary is None:
                self._primary = weakref.ref(optimizer)
        return steps_model

    def step(self) -> None:
        """``Monitor.step()``: a safe point that counts a step only while no optimizer of the
        model has been found."""
        if self._inactive() or self.m.status != "running":
            return  # a forked child, a closed block, or a Monitor never entered
        try:
            self.run(count=self.primary is None)
        except BudgetOutOfMemoryError:
            raise  # enforce=True: the budget's out-of-memory error is the user's to see
        except Exception as exc:
            self.m._agent_error("step", exc)

    def recovery_point(self) -> None:
        """Between a failed attempt and its retry (``run_step``): pressure hooks, then the
        pending policy action (no step is counted, nothing is measured). Never raises."""
        if self._inactive() or self.m.status != "running":
            return
        try:
            self.m._tuner.deliver_pressure_hooks()
            if self.m._coordinator is None:  # ranks apply only together, at a sync step
                self.m._tuner.at_recovery_point = True
                try:
                    self.m._tuner.apply_pending_decision()
                finally:
                    self.m._tuner.at_recovery_point = False
        except Exception as exc:
            self.m._agent_error("recovery point", exc)

    def _note_spent(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer``'s step: the gradients of the embedding tables it steps are spent
        (the step took them); their identity and version say so until a backward changes them."""
        tables = self._tables_of.get(optimizer)
        if tables is None:
            model = self.m.model
            held = {id(p) for g in optimizer.param_groups for p in g["params"]}
            tables = [
                m.weight
                for m in (model.modules() if model is not None else ())
                if isinstance(m, nn.Embedding | nn.EmbeddingBag) and id(m.weight) in held
            ]
            self._tables_of[optimizer] = tables
        for weight in tables:
            grad = weight.grad
            if grad is not None:
                self._spent[id(weight)] = (weakref.ref(weight), weakref.ref(grad), grad._version)

    def grad_spent(self, weight: torch.Tensor) -> bool:
        """Whether ``weight``'s gradient is the one its optimizer's last step took (the same
        tensor, unchanged since: no backward added to it), as :meth:`_note_spent` saw it."""
        seen, grad = self._spent.get(id(weight)), weight.grad
        return (
            grad is not None
            and seen is not None
            and seen[0]() is weight
            and seen[1]() is grad
            and seen[2] == grad._version
        )

    # ------------------------------------------------------------------ the boundary
    def run(self, *, count: bool) -> None:
        """The step boundary, on the training thread: the only place the model may change.

        Order: measure the step (accounting while gradients live; the activation profile), enforce
        the CPU budget against this step's peak, apply the pending decision, then close the step.
        Closing the step (count, activation peak, next profile) runs in ``finally``: an exception
        anywhere before it (the budget's out-of-memory error included: the optimizer step has run)
        never leaves the count behind or merges two steps.

        Raises:
            BudgetOutOfMemoryError: ``enforce=True`` and this step's peak exceeds the budget.
            Exception: with ``strict=True``, a failure inside the agent held back until now.
        """
        m = self.m
        tracker = m._tracker
        # forecasting needs one value per step, not per reading: where the step's peak can be
        # measured here (CPU-budget mode: the accounting plus the step's saved-tensor peak, the
        # sum a reading's in-use is) it is fed to the policy at every boundary
        forecasting = (
            m.policy is not None
            and m.policy.forecast_steps is not None
            and m._device.kind != "cuda"
        )
        try:
            # the profile first: the readings that see this step's accounting see its profile
            # too (table actions need one; recording starts on entering, so step 1 has it)
            self.collect_activation_profile()
            if self.want_accounting or self.enforcing or forecasting:
                # between optimizer step and zero_grad, gradients and optimizer state are all
                # alive: the step's peak of static memory (the sampler may land anywhere)
                self.want_accounting = False
                self.step_accounting = m._account()
            if self.enforcing and self.step_accounting is not None:
                self._check_step(self.step_accounting)
            if forecasting and self.step_accounting is not None:
                acc = self.step_accounting
                activations = tracker.step_peak_bytes if tracker is not None else 0
                m.policy.observe_step(
                    m.steps,
                    acc.total_bytes + activations,
                    {
                        "params_bytes": acc.params_bytes,
                        "grads_bytes": acc.grads_bytes,
                        "optimizer_state_bytes": acc.optimizer_state_bytes,
                        "activations_bytes": activations,
                    },
                )
            m._tuner.deliver_pressure_hooks()
            coordinator = m._coordinator
            if coordinator is None:
                m._tuner.apply_pending_decision()
            elif count and coordinator.due(m.steps + 1):
                coordinator.sync()  # the ranks agree; all apply the same decision, or none
        finally:
            self._close_step(count)
        if m.strict:
            err = m._log.take_pending_error()
            if err is not None:
                raise err

    def _check_step(self, acc: Accounting) -> None:
        """``enforce=True``: an optimizer's step against the CPU budget (every optimizer of the
        model, each right after its step: a second optimizer's state is made in its own step).

        The forward and backward were checked as they ran (the tracker, with the gradients
        alive); here the step: parameters, optimizer state and the gradients, with the saved
        tensors still alive (a retained graph). The request is what grew unchecked since the last
        check: the optimizer state (and the gradients, without a tracker to check them in the
        backward).

        Raises:
            BudgetOutOfMemoryError: what is alive exceeds the budget.
        """
        tracker = self.m._tracker
        self.rebase(acc)
        unchecked = acc.total_bytes - (acc.grads_bytes if self.grads_alive else 0)
        in_use = acc.total_bytes + (tracker.live_bytes if tracker is not None else 0)
        last, self._last_static_bytes = self._last_static_bytes, unchecked
        if in_use > (self.m.budget_bytes or 0):
            self.budget_exceeded(unchecked - last, in_use)

    def _close_step(self, count: bool) -> None:
        """Step bookkeeping; each part guarded so one failure cannot skip the others."""
        m = self.m
        if self._lazy:
            try:
                self._after_materialising()
            except Exception as exc:
                m._agent_error("lazy parameters", exc)
        if count:
            m.steps += 1
            writer = m._run.writer
            if writer is not None:
                writer.run_values["steps"] = m.steps
            if m._tracker is not None:
                try:
                    m._tracker.end_step()
                    self._check_growth(m._tracker.live_bytes)
                except Exception as exc:
                    m._agent_error("closing the step", exc)
        try:
            self.arm_activation_profile()
        except Exception as exc:
            m._agent_error("activation profile", exc)

    def _check_growth(self, activations_bytes: int) -> None:
        """Saved tensors alive at the step boundary: steady growth is a ``leak_suspected``."""
        suspicion = self._leaks.add(self.m.steps, "activations", activations_bytes)
        if suspicion is not None:
            self.m._emit(
                "leak_suspected",
                f"{suspicion.category} grow by {format_bytes(int(suspicion.growth_bytes_per_step))}"
                f" per step (steps {suspicion.first_step}-{suspicion.last_step})",
                dataclasses.asdict(suspicion),
            )

    def start_enforcing(self) -> None:
        """Check the CPU budget inside each step (``enforce=True`` without CUDA): the tracker's
        saved tensors and the gradients alive, against parameters and optimizer state."""
        m = self.m
        tracker = m._tracker
        if tracker is None or m.model is None:
            return
        tracker.limit_bytes = m.budget_bytes
        tracker.on_exceed = self.budget_exceeded
        self.grads_alive = GradientsAlive(tracker, m.model)
        self.rebase(m.accounting)
        self._last_static_bytes = tracker.static_bytes

    def rebase(self, acc: Accounting, *, rehook: bool = False) -> None:
        """The budget check's base after an accounting on the training thread: parameters and
        optimizer state; the gradients are counted anew (``rehook``: the parameters changed)."""
        tracker = self.m._tracker
        if tracker is None:
            return
        tracker.static_bytes = acc.total_bytes - acc.grads_bytes
        if self.grads_alive is not None:
            if rehook:
                self.grads_alive.watch()
            else:
                self.grads_alive.refresh()
        else:
            tracker.grads_bytes = acc.grads_bytes

    def _after_materialising(self) -> None:
        """Once a lazy module's parameters exist (its first forward), the hooks that skipped them
        take them in: the tracker stops counting them as saved activations, and with
        ``enforce=True`` their gradients are checked."""
        m = self.m
        if m.model is None or any(is_lazy(p) for p in m.model.parameters()):
            return
        self._lazy = False
        if m._tracker is not None:
            m._tracker.set_params(m._model_tensors())
        if self.grads_alive is not None:
            self.grads_alive.watch()

    def budget_exceeded(
        self, requested_bytes: int, in_use_bytes: int, category: str | None = None
    ) -> None:
        """Raise the CPU-budget out-of-memory error, recorded as an ``oom`` event first (so it is
        in the history even when the user catches it). The event's ``in_use`` is what was alive
        with the request, by category (``params_bytes``, ``grads_bytes``,
        ``optimizer_state_bytes``, ``activations_bytes``: an accounting now and the saved bytes
        the check counted, the request added to its ``category``), ``request`` (``category``, or
        ``"step"`` for the boundary's growth, already in the accounting) and
        ``requested_bytes``.

        Args:
            requested_bytes: the request that failed (a saved tensor's storage from the tracker's
                pack hook, a new gradient from its backward hook; the growth of static bytes since
                the last boundary from :meth:`run`).
            in_use_bytes: device-tier bytes in use with it; the message's accounted bytes are
                ``in_use_bytes - requested_bytes`` and its free bytes ``max(0, budget - that)``.
            category: ``"activations_bytes"`` or ``"grads_bytes"``: what the request is
                (``None``: the boundary's growth).

        Raises:
            BudgetOutOfMemoryError: always.
        """
        budget = self.m.budget_bytes
        assert budget is not None
        try:
            # the request as it was (a saved storage, or the static growth since the last
            # boundary): "accounted" is what was in use before it, even when that alone is over
            # the budget (a request stretched to the excess made it read "budget, 0 free")
            requested = min(max(1, requested_bytes), in_use_bytes)
            enforce_budget(
                budget,
                in_use_bytes,
                accounted_bytes=in_use_bytes - requested,
                requested_bytes=requested,
            )
        except BudgetOutOfMemoryError as exc:
            alive = exc._edo_in_use = self._alive_with(requested, category)  # type: ignore[attr-defined]
            try:
                self.m._record_oom(exc)
                if alive is not None:
                    self.m._sampler.record_oom(alive)
            except Exception as err:  # the user's error is the out-of-memory one
                self.m._agent_error("out-of-memory reading", err)
            finally:
                self.oom_accounting = None
            exc._edo_recorded = True  # type: ignore[attr-defined]
            if self.m._tracker is not None:
                self.m._tracker.end_attempt()
            raise

    def _alive_with(self, requested_bytes: int, category: str | None) -> dict[str, Any] | None:
        """What :meth:`budget_exceeded` records as alive with the request, as the check counted
        it (``None`` when it cannot be read): a new gradient is checked against the step's peak
        of saved bytes (:meth:`ActivationTracker.add_grad_bytes`), the rest against those alive."""
        m = self.m
        try:
            acc = self.oom_accounting = m._account()
            tracker = m._tracker
            saved = 0
            if tracker is not None:
                saved = tracker.step_peak_bytes if category == "grads_bytes" else tracker.live_bytes
            alive: dict[str, Any] = {
                "params_bytes": acc.params_bytes,
                "grads_bytes": acc.grads_bytes,
                "optimizer_state_bytes": acc.optimizer_state_bytes,
                "activations_bytes": saved,
                "request": category or "step",
                "requested_bytes": requested_bytes,
            }
        except Exception as exc:
            m._agent_error("out-of-memory breakdown", exc)
            return None
        if category is not None:
            alive[category] += requested_bytes
        return alive

    # ------------------------------------------------------------------ activation profile
    def arm_activation_profile(self) -> None:
        """Every ``profile_interval_s``, record the next step's forward per module."""
        m = self.m
        if (
            not m.track_activations
            or m.model is None
            or m.scripted
            or self._recorder is not None
            or time.monotonic() - self._profiled_at_s < m.profile_interval_s
        ):
            return
        tracker = m._tracker
        chain = (tracker.pack, tracker.unpack) if tracker is not None else None
        self._recorder = ActivationRecorder(m.model, chain=chain).__enter__()
        self._recorder_thread = threading.get_ident()
        self._measuring, self._to_measure = self._to_measure, []

    def collect_activation_profile(self) -> None:
        """End the recording armed at the previous boundary: its profile becomes
        ``Monitor.activation_profile`` and each module's activation bytes go to its row."""
        if self._recorder is None or not self._on_recorder_thread():
            return
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
        self._profiled_at_s = time.monotonic()
        for err in recorder.errors:  # its hooks caught them; the forward went on
            self.m._agent_error("activation profile hook", err)
        profile = recorder.profile()
        previous = self.m.activation_profile
        if previous is not None and previous.outside_uses:
            # a read of a table's weight outside its module seen on any recorded step counts
            # (an L2 penalty every 10th step is not on every recorded step)
            uses = dict(profile.outside_uses)
            for table, where in previous.outside_uses.items():
                uses[table] = tuple(sorted({*uses.get(table, ()), *where}))
            profile = dataclasses.replace(profile, outside_uses=uses)
        if previous is not None and previous.grad_edits:  # as sticky: every 10th step's clipping
            profile = dataclasses.replace(
                profile, grad_edits=profile.grad_edits | previous.grad_edits
            )
        self.m.activation_profile = profile
        self.m._module_rows.write_activations(profile.exclusive_bytes, time.time())
        measuring, self._measuring = self._measuring, []
        for decision, result, before in measuring:
            self.m._tuner.record_measured(decision, result, before, profile)

    def measure_after(self, decision: Any, result: Any) -> None:
        """Measure applied ``result``'s saving (of ``decision``) on the next recorded forward,
        against the profile it was planned from: one is recorded from the next boundary on,
        whatever ``profile_interval_s`` says (a recording already running began before the
        action and does not count)."""
        self._to_measure.append((decision, result, self.m.activation_profile))
        self._profiled_at_s = -float("inf")

    def close_recorder(self) -> None:
        """Stop a recording still armed (the run is ending)."""
        from edo_monitor.agent.spectrum import record_table_spectra

        record_table_spectra(self.m)  # the run is ending: each table's sampled spectrum
        if self._recorder is not None and self._on_recorder_thread():
            self._recorder.__exit__(None, None, None)
        self._recorder = None

    def _on_recorder_thread(self) -> bool:
        """Whether this runs on the thread that armed the recording: its saved-tensor hooks and
        dispatch mode are that thread's own (PyTorch keeps them per thread; popped on another,
        its assertion fails and they stay on the first, with the tracker's out-of-memory check
        after the run). A training loop on another thread than the one that entered ``watch()``
        is warned about once: its activations are not measured."""
        if threading.get_ident() == self._recorder_thread:
            return True
        if not self._warned_thread:
            self._warned_thread = True
            logger.warning(
                "edo-monitor: the model trains on another thread than the one that entered "
                "watch(): its saved-for-backward bytes (activations) are not measured and no "
                "activation profile is recorded (PyTorch's saved-tensor hooks belong to one "
                "thread); enter watch() on the training thread"
            )
        return False
