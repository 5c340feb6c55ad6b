"""LDPCache accountant: budget, composition, refusal, and the ledger across crashes."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmkit.serving.ldp_cache.accountant import BudgetExceeded, PrivacyLedger


class Crash(BaseException):
    pass


def test_sequential_composition_and_clear_refusal(tmp_path):
    led = PrivacyLedger(tmp_path / "l.sqlite", default_budget=10.0)
    for _ in range(3):
        led.settle(led.reserve("alice", 3.0))
    assert led.spent("alice") == pytest.approx(9.0) and led.remaining("alice") == pytest.approx(1.0)
    with pytest.raises(BudgetExceeded, match=r"user 'alice'.*spent 9 of epsilon 10.*needs up to 3") as e:
        led.reserve("alice", 3.0)
    assert e.value.spent == pytest.approx(9.0)
    assert led.spent("alice") == pytest.approx(9.0)  # a refusal writes nothing
    assert led.spent("bob") == 0.0  # budgets are per user
    led.set_budget("bob", 1.0)
    with pytest.raises(BudgetExceeded):
        led.reserve("bob", 1.5)


def test_settle_shrinks_never_grows_and_release_refunds(tmp_path):
    led = PrivacyLedger(tmp_path / "l.sqlite", default_budget=10.0)
    r = led.reserve("u", 5.0)
    assert led.spent("u") == pytest.approx(5.0)  # a reservation already counts
    assert led.settle(r, 2.0) == pytest.approx(2.0)
    assert led.spent("u") == pytest.approx(2.0)
    with pytest.raises(ValueError, match="reserve more"):
        led.settle(led.reserve("u", 1.0), 4.0)
    r3 = led.reserve("u", 3.0)
    led.release(r3)
    assert led.spent("u") == pytest.approx(3.0)  # 2 settled + 1 still reserved


def test_float_noise_never_lets_the_total_pass_the_budget(tmp_path):
    led = PrivacyLedger(tmp_path / "l.sqlite", default_budget=1.0)
    n = 0
    while True:
        try:
            led.settle(led.reserve("u", 0.1))
            n += 1
        except BudgetExceeded:
            break
    assert n == 10 and led.spent("u") <= 1.0


ops = st.lists(st.tuples(st.floats(0.0, 4.0, allow_nan=False),
                         st.sampled_from(["settle", "shrink", "unsent", "crash-before-commit",
                                          "crash-after-reserve", "crash-after-send"])),
               min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.floats(0.0, 30.0, allow_nan=False), stream=ops)
def test_ledger_never_exceeds_budget_nor_undercounts_across_crashes(tmp_path_factory, budget, stream):
    """A random query stream with simulated crashes at every step of the protocol.

    'sent' is what the upstream has seen (written only after the reservation committed, as
    the client does). Invariants after every step, on a ledger reopened from disk after
    each crash: booked <= budget, and booked >= everything sent.
    """
    path = tmp_path_factory.mktemp("ledger") / "l.sqlite"
    led = PrivacyLedger(path, budget)
    sent = 0.0
    for amount, outcome in stream:
        if outcome == "crash-before-commit":
            led._fault = lambda stage: (_ for _ in ()).throw(Crash(stage))
        try:
            res = led.reserve("u", amount)
        except BudgetExceeded:
            res = None
        except Crash:
            led = PrivacyLedger(path, budget)  # the process died mid-transaction; restart
            res = None
        if res is not None:
            if outcome == "crash-after-reserve":
                led = PrivacyLedger(path, budget)  # died before sending: the reservation stays
            elif outcome == "unsent":
                led.release(res)  # provably nothing left the device
            else:
                sent += res.amount
                if outcome == "crash-after-send":
                    led = PrivacyLedger(path, budget)
                else:
                    led.settle(res, res.amount / 2 if outcome == "shrink" else None)
                    if outcome == "shrink":
                        sent -= res.amount / 2  # only half was released (e.g. a cache hit)
        booked = led.spent("u")
        assert booked <= budget + 1e-9
        assert booked >= sent - 1e-6


def _spender(path: str, budget: float, log: str, kill_after: int) -> None:
    led = PrivacyLedger(path, budget)
    i = 0
    while True:
        try:
            res = led.reserve("u", 0.7)
        except BudgetExceeded:
            os._exit(0)
        with open(log, "a") as f:  # the "upstream" sees the query only after the reserve committed
            f.write(f"{res.amount}\n")
            f.flush()
            os.fsync(f.fileno())
        i += 1
        if i == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        led.settle(res, 0.5 if i % 2 else None)


def test_sigkilled_processes_never_undercount_or_overspend(tmp_path):
    path, log = str(tmp_path / "l.sqlite"), str(tmp_path / "sent.log")
    PrivacyLedger(path, 10.0)
    ctx = mp.get_context("fork")
    for kill_after in (3, 1, 4, 100):  # three crashes mid-protocol, then one run to exhaustion
        p = ctx.Process(target=_spender, args=(path, 10.0, log, kill_after))
        p.start()
        p.join(60)
        assert p.exitcode in (0, -signal.SIGKILL)
    led = PrivacyLedger(path, 10.0)
    with open(log) as f:
        sent = [float(x) for x in f.read().split()]
    booked = led.spent("u")
    assert booked <= 10.0
    # every settled query shrank to 0.5 or stayed 0.7; crashed ones stay at their full reservation
    assert booked >= 0.5 * len(sent) - 1e-9
    assert math.isclose(booked + 0.7, 10.0, abs_tol=0.7)  # ran until the next 0.7 no longer fit


def _concurrent(path: str) -> None:
    led = PrivacyLedger(path, 25.0)
    while True:
        try:
            led.settle(led.reserve("u", 1.0))
        except BudgetExceeded:
            return


def test_concurrent_processes_share_one_budget(tmp_path):
    path = str(tmp_path / "l.sqlite")
    PrivacyLedger(path, 25.0)
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=_concurrent, args=(path,)) for _ in range(3)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
    assert PrivacyLedger(path, 25.0).spent("u") == pytest.approx(25.0)
