"""The KV-cache manager: one facade over collaborators that own their state.

:class:`KVCacheManager` (``facade.py``) builds the collaborators, holds the one lock and only
delegates:

- :class:`~jax_kvcm.manager.rows.RowTable` (``rows.py``): one row per open sequence, the page
  tables of every layer-group kind, token ids, and the :class:`~jax_kvcm.StepBatch` gather;
- :class:`~jax_kvcm.manager.ledger.StepLedger` (``ledger.py``): the step in flight, completion
  fences, pending frees;
- :class:`~jax_kvcm.manager.planner.TierPlanner` (``planner.py``): room on every tier, eviction,
  moves as storage transactions; :class:`~jax_kvcm.manager.ahead.WriteBackAhead` (``ahead.py``):
  write-back ahead; :class:`~jax_kvcm.manager.arena_room.ArenaRoom` (``arena_room.py``): the
  arena's ranges and device room, when the hot tier is an arena;
- :class:`~jax_kvcm.manager.committer.Committer` (``committer.py``): full pages into the prefix
  tree under the one block-key formula;
- :class:`~jax_kvcm.manager.lifecycle.Lifecycle` (``lifecycle.py``): admission with prefix
  reuse and onboarding, close, suspend, resume, loss of the device;
- :class:`~jax_kvcm.manager.steps.StepRunner` (``steps.py``): prepare / complete / abort;
- :class:`~jax_kvcm.manager.observers.Observers` and ``Stats`` (``observers.py``): counters,
  the lock, events (opt-in);
- :class:`~jax_kvcm.manager.invariants.Invariants` (``invariants.py``): page accounting and
  the checks tests run.

Under them, the storage manager (:mod:`jax_kvcm._storage`) owns the tiers, and its device tier is
a :mod:`hot tier <jax_kvcm.hot>` (paged pools or an arena) chosen by ``KVCacheConfig.hot``.

Rules (``tests/manager/test_manager_structure.py`` checks the first three):

- nothing imports the facade (``facade.py``); collaborators import each other and the records
  of ``api.py``;
- collaborators never touch each other's fields: each is given the others it uses through its
  constructor and calls their methods and properties (never an ``_underscored`` attribute of
  another object; the ``Sequence`` handle's slots are the manager's shared record);
- no file in ``jax_kvcm/`` is over 600 lines;
- one refusal convention: a capacity refusal returns a value (``None``, ``False``,
  ``MUST_RECOMPUTE``) or raises :class:`OutOfPagesError` from ``prepare_step``, having changed
  nothing; misuse raises ``ValueError`` / ``TypeError`` naming the argument.
"""

from jax_kvcm.manager.api import (ManagerEvent, OutOfPagesError, Sequence, SequencePhase,
                                  SequenceState, SequenceView, StepInFlightError,
                                  SuspendResult)
from jax_kvcm.manager.config import ArenaHot, KVCacheConfig, LayerGroupConfig, PagedHot
from jax_kvcm.manager.facade import KVCacheManager
from jax_kvcm.manager.handoff import SequenceExport

__all__ = [
    "ArenaHot",
    "KVCacheConfig",
    "KVCacheManager",
    "LayerGroupConfig",
    "ManagerEvent",
    "OutOfPagesError",
    "PagedHot",
    "Sequence",
    "SequenceExport",
    "SequencePhase",
    "SequenceState",
    "SequenceView",
    "StepInFlightError",
    "SuspendResult",
]
