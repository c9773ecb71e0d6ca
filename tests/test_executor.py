"""The engine's executor on one thread: it plays a graph's tasks in the order
given (one that respects every dependency), and refuses a memory order it
could not wait for, saying so."""

from __future__ import annotations

import pytest
from conftest import simple_hardware, tiny_spec

import harmony
from harmony import Plan
from harmony.engine.executor import Executor


def graph():
    plan = Plan("harmony-pp", 1, 6, 2, 2, ((0, 2),), ((0, 2), (2, 4)))
    return harmony.build_graph(tiny_spec(4), simple_hardware(1), plan)


def test_one_thread_plays_the_order_given():
    g = graph()
    # an order the lanes would not play (the seq order): the updates last
    order = sorted(g.tasks, key=lambda t: (t.kind == "UPD", t.seq))
    assert [t.id for t in order] != [t.id for t in sorted(g.tasks, key=lambda t: t.seq)]
    played = []
    Executor(g, played.append, one_thread=True, order=order).run()
    assert [t.id for t in played] == [t.id for t in order]


def test_one_thread_refuses_a_memory_order_and_says_why():
    with pytest.raises(ValueError, match="cannot wait for a memory order"):
        Executor(graph(), lambda t: None, admission=object(), one_thread=True)
