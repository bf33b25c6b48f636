"""MemoryGovernor: limits, leases, transient bytes, exact rollback, peaks."""

from __future__ import annotations

import contextlib
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_kvcm._governor import BudgetExceededError, LeaseState, MemoryGovernor
from jax_kvcm._types import CacheLevel

DEVICE, HOST, DISK = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK


class Boom(Exception):
    """An injected failure."""


def make(device: int = 1000, host: int = 500, disk: int = 0) -> MemoryGovernor:
    return MemoryGovernor({DEVICE: device, HOST: host, DISK: disk})


def test_reserve_commit_release_counts():
    gov = make()
    lease = gov.reserve(HOST, 200)
    u = gov.usage(HOST)
    assert (u.reserved, u.committed, u.current, u.held, u.available) == (200, 0, 0, 200, 300)
    assert lease.state is LeaseState.PENDING and not lease.transient and lease.nbytes == 200
    lease.commit()
    u = gov.usage(HOST)
    assert (u.reserved, u.committed, u.current, u.held, u.num_leases) == (0, 200, 200, 200, 1)
    assert lease.state is LeaseState.COMMITTED
    lease.release()
    u = gov.usage(HOST)
    assert (u.committed, u.held, u.num_leases, u.peak) == (0, 0, 0, 200)
    assert lease.state is LeaseState.RELEASED


def test_refused_reservation_changes_nothing_and_is_typed():
    gov = make()
    kept = gov.reserve(HOST, 300)
    kept.commit()
    gov.reserve(HOST, 100, transient=True).commit()
    before = gov.ledger()
    with pytest.raises(BudgetExceededError) as info:
        gov.reserve(HOST, 101)
    err = info.value
    assert (err.level, err.requested, err.available) == (HOST, 101, 100)
    assert "HOST" in str(err) and "101" in str(err)
    with pytest.raises(BudgetExceededError):
        gov.reserve(HOST, 101, transient=True)
    assert gov.ledger() == before
    # The exact remainder still fits.
    with gov.reserve(HOST, 100):
        assert gov.available(HOST) == 0
    assert gov.ledger() == before
    # A level without a limit refuses anything but zero bytes.
    with pytest.raises(BudgetExceededError) as info:
        gov.reserve(DISK, 1)
    assert (info.value.level, info.value.available) == (DISK, 0)
    gov.reserve(DISK, 0).release()
    assert gov.ledger() == before


def test_error_pickles_with_fields():
    err = pickle.loads(pickle.dumps(BudgetExceededError(DISK, 7, 3)))
    assert (err.level, err.requested, err.available) == (DISK, 7, 3)


def test_context_manager_rolls_back_on_exception_and_without_commit():
    gov = make()
    gov.reserve(DEVICE, 123).commit()
    before = gov.ledger()
    with pytest.raises(Boom):
        with gov.reserve(DEVICE, 400) as a, gov.reserve(DEVICE, 50, transient=True) as b:
            assert gov.usage(DEVICE).held == 573
            raise Boom
    assert a.state is b.state is LeaseState.RELEASED
    assert gov.ledger() == before
    with gov.reserve(DEVICE, 400) as a:
        pass  # no commit: rolled back on exit
    assert a.state is LeaseState.RELEASED and gov.ledger() == before


def test_committed_lease_survives_with_block():
    gov = make()
    with gov.reserve(HOST, 10) as p, gov.reserve(HOST, 20, transient=True) as t:
        p.commit()
        t.commit()
    u = gov.usage(HOST)
    assert (u.committed, u.transient_in_flight, u.num_leases) == (10, 20, 2)
    t.release()  # the migration's finish fence became ready
    p.release()
    assert gov.usage(HOST).held == 0


def test_transient_counted_separately_but_inside_limit():
    gov = make(host=100)
    p = gov.reserve(HOST, 60)
    t = gov.reserve(HOST, 30, transient=True)
    u = gov.usage(HOST)
    assert (u.reserved, u.transient_reserved, u.transient, u.available) == (60, 30, 30, 10)
    with pytest.raises(BudgetExceededError) as info:
        gov.reserve(HOST, 11, transient=True)
    assert info.value.available == 10
    t.commit()
    u = gov.usage(HOST)
    assert (u.transient_reserved, u.transient_in_flight, u.current) == (0, 30, 30)
    p.commit()
    assert gov.usage(HOST).current == 90
    t.release()
    u = gov.usage(HOST)
    assert (u.transient, u.committed, u.peak, u.iteration_peak_transient) == (0, 60, 90, 30)


def test_peaks_track_commits_and_reset_per_iteration():
    gov = make(device=1000)
    a = gov.reserve(DEVICE, 300)
    assert gov.usage(DEVICE).peak == 0  # pending bytes are not in use yet
    a.commit()
    t = gov.reserve(DEVICE, 200, transient=True)
    t.commit()
    t.release()
    stats = gov.get_and_reset_iteration_peak_stats(DEVICE)
    assert (stats.level, stats.peak_bytes, stats.peak_transient_bytes, stats.current_bytes) == (
        DEVICE, 500, 200, 300)
    u = gov.usage(DEVICE)
    assert (u.iteration_peak, u.iteration_peak_transient, u.peak) == (300, 0, 500)
    # A new iteration: smaller activity; the iteration peak restarts from current usage.
    gov.reserve(DEVICE, 50).commit()
    stats = gov.get_and_reset_iteration_peak_stats(DEVICE)
    assert (stats.peak_bytes, stats.peak_transient_bytes, stats.current_bytes) == (350, 0, 350)
    a.release()
    stats = gov.get_and_reset_iteration_peak_stats(DEVICE)
    assert (stats.peak_bytes, stats.current_bytes) == (350, 50)
    assert gov.usage(DEVICE).peak == 500
    # Levels are independent.
    assert gov.get_and_reset_iteration_peak_stats(HOST).peak_bytes == 0


def test_rolled_back_reservation_leaves_no_trace_in_peaks():
    gov = make(device=1000)
    gov.reserve(DEVICE, 100).commit()
    gov.get_and_reset_iteration_peak_stats(DEVICE)
    before = gov.ledger()
    with pytest.raises(Boom):
        with gov.reserve(DEVICE, 800), gov.reserve(DEVICE, 100, transient=True):
            raise Boom
    assert gov.ledger() == before
    assert gov.get_and_reset_iteration_peak_stats(DEVICE).peak_bytes == 100


def test_misuse_raises():
    gov = make()
    lease = gov.reserve(HOST, 1)
    lease.release()
    with pytest.raises(RuntimeError, match="release of a released"):
        lease.release()
    with pytest.raises(RuntimeError, match="commit of a released"):
        lease.commit()
    lease = gov.reserve(HOST, 1)
    lease.commit()
    with pytest.raises(RuntimeError, match="commit of a committed"):
        lease.commit()
    before = gov.ledger()
    with pytest.raises(ValueError, match="nbytes"):
        gov.reserve(HOST, -1)
    for bad in (1.0, True, "1", None):
        with pytest.raises(TypeError, match="nbytes"):
            gov.reserve(HOST, bad)
    with pytest.raises(ValueError):
        gov.reserve(7, 1)
    assert gov.ledger() == before
    gov.reserve(HOST, np.int64(2)).release()  # numpy ints are ints
    with pytest.raises(ValueError, match="limit of HOST"):
        MemoryGovernor({HOST: -1})
    with pytest.raises(TypeError):
        MemoryGovernor({HOST: 1.5})
    with pytest.raises(ValueError):
        MemoryGovernor({5: 1})
    assert MemoryGovernor({1: 10}).limit(HOST) == 10
    assert MemoryGovernor({}).limit(DEVICE) == 0


# ---------------------------------------------------------------------------------------------
# A migration transaction with a failure injected at every step.

STEPS = ("reserve_dst", "reserve_transient", "allocate", "submit")


def migrate(gov: MemoryGovernor, fail_at: str | None, in_flight: list) -> None:
    """hot->disk shape: destination bytes at DISK, staging bytes at HOST (transient)."""

    def step(name: str) -> None:
        if name == fail_at:
            raise Boom(name)

    if fail_at == "reserve_dst":  # a real refusal, not a synthetic exception
        gov.reserve(DISK, gov.available(DISK) + 1)
    with gov.reserve(DISK, 64) as dst:
        if fail_at == "reserve_transient":
            gov.reserve(HOST, gov.available(HOST) + 1, transient=True)
        with gov.reserve(HOST, 64, transient=True) as staging:
            step("allocate")
            step("submit")
            dst.commit()
            staging.commit()
            in_flight.append(staging)


@pytest.mark.parametrize("fail_at", STEPS)
def test_failed_transaction_rolls_back_exactly(fail_at):
    gov = make(device=1000, host=500, disk=1000)
    in_flight: list = []
    migrate(gov, None, in_flight)  # some prior state, including an in-flight transient
    gov.get_and_reset_iteration_peak_stats(HOST)
    before = gov.ledger()
    with pytest.raises((Boom, BudgetExceededError)):
        migrate(gov, fail_at, in_flight)
    assert gov.ledger() == before, fail_at
    assert len(in_flight) == 1
    # Retry succeeds, and (negative control) a successful call does change the ledger.
    migrate(gov, None, in_flight)
    after = gov.ledger()
    assert after != before
    assert after[DISK].committed == 128 and after[HOST].transient_in_flight == 128
    for lease in in_flight:
        lease.release()
    assert gov.usage(HOST).transient == 0


# ---------------------------------------------------------------------------------------------
# Randomized: random operation sequences against a plain model.

LEVELS = st.sampled_from(list(CacheLevel))


@settings(max_examples=300, deadline=None, print_blob=True)
@given(st.data())
def test_random_operations_match_model(data):
    limits = {level: data.draw(st.integers(0, 400), label=f"limit {level.name}")
              for level in CacheLevel}
    gov = MemoryGovernor(limits)
    leases: list = []  # every lease ever made, with the model's view of it
    peak = {level: 0 for level in CacheLevel}
    it_peak = {level: 0 for level in CacheLevel}
    it_peak_t = {level: 0 for level in CacheLevel}

    def model_buckets(level):
        b = {"reserved": 0, "committed": 0, "transient_reserved": 0, "transient_in_flight": 0}
        for lease, state in leases:
            if lease.level != level or state == "released":
                continue
            key = {("pending", False): "reserved", ("committed", False): "committed",
                   ("pending", True): "transient_reserved",
                   ("committed", True): "transient_in_flight"}[state, lease.transient]
            b[key] += lease.nbytes
        return b

    for _ in range(data.draw(st.integers(1, 40), label="num_ops")):
        op = data.draw(st.sampled_from(["reserve", "commit", "release", "reset", "txn"]))
        before = gov.ledger()
        if op == "reserve":
            level = data.draw(LEVELS)
            n = data.draw(st.integers(0, 200))
            transient = data.draw(st.booleans())
            avail = limits[level] - sum(model_buckets(level).values())
            if n > avail:
                with pytest.raises(BudgetExceededError) as info:
                    gov.reserve(level, n, transient=transient)
                assert (info.value.requested, info.value.available) == (n, avail)
                assert gov.ledger() == before
            else:
                leases.append([gov.reserve(level, n, transient=transient), "pending"])
        elif op in ("commit", "release") and leases:
            k = data.draw(st.integers(0, len(leases) - 1))
            lease, state = leases[k]
            legal = state == "pending" if op == "commit" else state != "released"
            if not legal:
                with pytest.raises(RuntimeError):
                    getattr(lease, op)()
                assert gov.ledger() == before
            else:
                getattr(lease, op)()
                leases[k][1] = "committed" if op == "commit" else "released"
                if op == "commit":
                    b = model_buckets(lease.level)
                    cur = b["committed"] + b["transient_in_flight"]
                    peak[lease.level] = max(peak[lease.level], cur)
                    it_peak[lease.level] = max(it_peak[lease.level], cur)
                    it_peak_t[lease.level] = max(it_peak_t[lease.level],
                                                 b["transient_in_flight"])
        elif op == "reset":
            level = data.draw(LEVELS)
            stats = gov.get_and_reset_iteration_peak_stats(level)
            assert (stats.peak_bytes, stats.peak_transient_bytes) == (it_peak[level],
                                                                      it_peak_t[level])
            b = model_buckets(level)
            it_peak[level] = b["committed"] + b["transient_in_flight"]
            it_peak_t[level] = b["transient_in_flight"]
        elif op == "txn":
            # Several reservations, then a failure: everything rolls back exactly.
            sizes = data.draw(st.lists(st.tuples(LEVELS, st.integers(0, 150), st.booleans()),
                                       min_size=1, max_size=4))
            with pytest.raises((Boom, BudgetExceededError)):
                with contextlib.ExitStack() as stack:
                    for level, n, transient in sizes:
                        stack.enter_context(gov.reserve(level, n, transient=transient))
                    raise Boom
            assert gov.ledger() == before
        # Compare everything with the model.
        for level in CacheLevel:
            u = gov.usage(level)
            b = model_buckets(level)
            assert (u.reserved, u.committed, u.transient_reserved, u.transient_in_flight) == (
                b["reserved"], b["committed"], b["transient_reserved"], b["transient_in_flight"])
            assert u.num_leases == sum(1 for lease, s in leases
                                       if lease.level == level and s != "released")
            assert 0 <= u.held <= u.limit == limits[level]
            assert (u.peak, u.iteration_peak, u.iteration_peak_transient) == (
                peak[level], it_peak[level], it_peak_t[level])
            assert u.current <= u.iteration_peak <= u.peak
